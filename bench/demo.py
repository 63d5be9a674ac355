"""What ``make demo`` costs and reaches: ``python -m bench.demo`` (about 4 minutes on 2 CPU cores).

Runs ``make demo``'s command, ``python cli.py fit --test_after_fit best``, as a user would (a new process each time,
imports included) in a temporary run folder, once per seed (``--seed_everything``; the first is the config's own
1234, what ``make demo`` runs), and reads back what it printed and wrote: the wall time of the command, the official
10k test-set accuracy, the run's training summary (``summary.json``) and the model summary's parameter and FLOP counts.
Then, in the same script on the same machine, the previous demo once as the baseline: ``python cli.py fit`` and
``python cli.py test --ckpt_path last`` with ``configs/mnist_2epochs.yaml`` (the previous default recipe) and
``--data.resident false`` (the DataLoader's per-sample path). Writes ``results/demo.{json,md}``; the README quotes
them. ``--smoke``: one seed, 5 batches, no baseline (a check of this script; results in runs/bench-smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, machine_line, save

SEEDS = [1234, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # 1234: configs/base.yaml's seed_everything, what `make demo` runs
DEMO = ["fit", "--test_after_fit", "best"]
BEFORE = ["--config", "configs/mnist_2epochs.yaml", "--data.resident", "false"]
SMOKE = ["--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2"]


def timed(args: list[str]) -> tuple[float, str]:
    """Runs ``python cli.py ARGS``; returns its wall time and output, or raises with the output's end."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"`python cli.py {' '.join(args)}` failed (exit {done.returncode}):\n{output[-3000:]}")
    return seconds, output


def _number(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"the output has no {pattern!r}")
    return match.group(1)


def _summary(root: str) -> dict[str, Any]:
    return json.loads(next(Path(root).glob("version_*/summary.json")).read_text())


def one_demo(seed: int, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="demo-") as tmp:
        seconds, out = timed([*DEMO, "--trainer.default_root_dir", tmp, "--seed_everything", str(seed), *extra])
        summary = _summary(tmp)
    return {
        "seed": seed,
        "wall_s": round(seconds, 2),
        "test_acc1": float(_number(r"test/acc1\W+([0-9.]+)", out)),
        "test_images": _number(r"test: evaluated (\d+/\d+) images", out),
        "best_val_acc1": summary["best val/acc1"],
        "steps": summary["steps"],
        "images_per_s": summary["mean images/s (global)"],
        "params": _number(r"Total params:?\s+([0-9.]+ ?[KM]?)", out).strip(),
        "flops_per_image": _number(r"Total FLOPs:?\s+([0-9.]+ ?[KMG]?)", out).strip(),
        "resident": "so they stay there" in out,
    }


def before(extra: list[str]) -> dict[str, Any]:
    """The previous `make demo`: two processes, the previous recipe, the DataLoader's path."""
    with tempfile.TemporaryDirectory(prefix="demo-before-") as tmp:
        common = [*BEFORE, "--trainer.default_root_dir", tmp, *extra]
        fit_s, _ = timed(["fit", *common])
        test_s, test_out = timed(["test", "--ckpt_path", "last", *common])
        summary = _summary(tmp)
    return {
        "commands": [f"python cli.py {command} {' '.join(BEFORE)}" for command in ("fit", "test --ckpt_path last")],
        "fit_s": round(fit_s, 1),
        "test_s": round(test_s, 1),
        "wall_s": round(fit_s + test_s, 1),
        "test_acc1": float(_number(r"test/acc1\W+([0-9.]+)", test_out)),
        "steps": summary["steps"],
        "images_per_s": summary["mean images/s (global)"],
    }


def run(seeds: list[int], extra: list[str], baseline: bool) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    runs = []
    for seed in seeds:
        runs.append(one_demo(seed, extra))
        print(f"seed {seed}: {runs[-1]['wall_s']} s, test {runs[-1]['test_acc1']:.2%}", flush=True)
    result: dict[str, Any] = {
        "machine": machine(),
        "command": "python cli.py " + " ".join(DEMO),
        "extra_args": extra,
        "runs": runs,
        "before": before(extra) if baseline else None,
        "load_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    return result


def _stats(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))} - {fmt.format(max(values))})"


def markdown(result: dict[str, Any]) -> str:
    runs, b = result["runs"], result["before"]
    first = runs[0]
    before_load, after_load = result["load_before_after"]
    extra = " -- " + " ".join(result["extra_args"]) if result["extra_args"] else ""
    lines = [
        "# `make demo`: the default MNIST run, fit and test in one process",
        "",
        f"Machine: {machine_line(result['machine'])}. Load average (1 min) before / after: {before_load} / "
        f"{after_load}.",
        f"Command: `python -m bench.demo{extra}`: `{result['command']}` in a new process per seed, imports included, "
        f"seeds {', '.join(str(r['seed']) for r in runs)} (the first is the config's own, what `make demo` runs).",
        "",
        "| what | now: mean (min - max) over the seeds | seed "
        + str(first["seed"])
        + " |"
        + (" before: the previous demo |" if b else ""),
        "|---|---|---|" + ("---|" if b else ""),
        f"| wall time, fit and test (imports included) | {_stats([r['wall_s'] for r in runs], '{:.1f} s')} | "
        f"{first['wall_s']:.1f} s |" + (f" {b['wall_s']} s ({b['fit_s']} s fit + {b['test_s']} s test) |" if b else ""),
        f"| official test set accuracy (`test/acc1`, {first['test_images']} images) | "
        f"{_stats([100 * r['test_acc1'] for r in runs], '{:.2f}%')} | {first['test_acc1']:.2%} |"
        + (f" {b['test_acc1']:.2%} |" if b else ""),
        f"| best `val/acc1` (5k held-out training images) | "
        f"{_stats([100 * r['best_val_acc1'] for r in runs], '{:.2f}%')} | {first['best_val_acc1']:.2%} |"
        + (" |" if b else ""),
        f"| optimizer steps | {first['steps']} | {first['steps']} |" + (f" {b['steps']} |" if b else ""),
        f"| mean training images/s | {_stats([r['images_per_s'] for r in runs], '{:,.0f}')} | "
        f"{first['images_per_s']:,.0f} |" + (f" {b['images_per_s']:,.0f} |" if b else ""),
        f"| model: parameters, FLOPs per image (forward) | {first['params']}, {first['flops_per_image']} | |"
        + (" 29.2 K, 3.8 M (`mnist_fast`) |" if b else ""),
        f"| seeds at or above 99.0% test accuracy | {sum(r['test_acc1'] >= 0.99 for r in runs)} of {len(runs)} | |"
        + (" |" if b else ""),
    ]
    if b:
        mean = statistics.mean(r["wall_s"] for r in runs)
        lines += [
            "",
            f"Before: `{b['commands'][0]}`, then `{b['commands'][1]}` (the previous default recipe, 2 epochs of batch "
            f"128, and the DataLoader's per-sample path). Now / before: {b['wall_s'] / mean:.1f}x faster.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for demo.{json,md} (default bench/results)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"how many of {SEEDS} to run")
    parser.add_argument("--smoke", action="store_true", help="one seed of 5 batches, no baseline")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.smoke:
        args.seeds, extra = 1, [*SMOKE, *extra]
    out = args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else RESULTS)
    result = run(SEEDS[: args.seeds], extra, baseline=not args.smoke)
    save(out, "demo", result, markdown)
    return result


if __name__ == "__main__":
    main()
