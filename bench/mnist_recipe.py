"""How the default MNIST recipe was chosen: candidates over seeds, judged on the 5k validation split.

``python -m bench.mnist_recipe`` (about 10 minutes on 2 CPU cores) trains each candidate, a change of
``configs/mnist.yaml`` given as command-line arguments, once per seed (``--seed_everything``), through the app's own
CLI in this process (``app.command.main``: the same run as ``python cli.py fit``, imports and the first run's one-off
costs paid once, in an untimed run before the others), and records its
training wall time (``fit``, validation and checkpoints included), its validation accuracy and, after the choice is
made, its test accuracy (``--test_after_fit last``). The rule: the fastest candidate whose mean validation accuracy is
at least 99.0%. The test set is reported, never used to choose. Writes ``results/mnist_recipe.{json,md}``.
``--smoke``: the first candidate, one seed, 40 training batches, no untimed run (a check of this script; results in
runs/bench-smoke).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, machine_line, save

TARGET = 0.99
CANDIDATES: dict[str, list[str]] = {
    "default: mnist_lenet, Adam + OneCycle, label smoothing 0.1, batch 256, 1 epoch": [],
    "without label smoothing": ["--model.label_smoothing", "0"],
    "batch 128": ["--data.batch_size", "128"],
    "2 epochs": ["--trainer.max_epochs", "2"],
    "mnist_fast (BatchNorm CNN) instead of mnist_lenet": ["--model.arch", "mnist_fast"],
}  # the previous default (configs/mnist_2epochs.yaml, about 60 s a run here) is measured by bench.demo
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def one(args: list[str], seed: int) -> dict[str, float]:
    from app.command import main

    with tempfile.TemporaryDirectory(prefix="recipe-") as root:
        start = time.perf_counter()
        cli = main(["fit", *args, *QUIET, "--trainer.default_root_dir", root, "--seed_everything", str(seed),
                    "--test_after_fit", "last"])  # fmt: skip
        seconds = time.perf_counter() - start
        # the training summary's last validation (trainer.test has replaced the callback metrics with its own)
        summary = json.loads(next(Path(root).glob("version_*/summary.json")).read_text())
        test = float(cli.trainer.callback_metrics["test/acc1"])
        result = {"seed": seed, "fit_and_test_s": seconds, "val_acc1": summary["last val/acc1"], "test_acc1": test,
                  "steps": cli.trainer.global_step}  # fmt: skip
    del cli
    gc.collect()
    return result


def summary(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def run(seeds: list[int], candidates: dict[str, list[str]], warm_up: bool = True) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if warm_up:  # untimed: this process's one-off costs (lazy imports, allocator)
        one(next(iter(candidates.values())), seeds[0])
    for name, args in candidates.items():
        runs = [one(args, seed) for seed in seeds]
        found[name] = {"args": args, "runs": runs, **{k: summary(runs, k) for k in ("fit_and_test_s", "val_acc1",
                                                                                   "test_acc1")}}  # fmt: skip
        print(f"{name}: val {found[name]['val_acc1']['mean']:.4f}, {found[name]['fit_and_test_s']['mean']:.1f} s",
              flush=True)  # fmt: skip
    passing = [n for n, c in found.items() if c["val_acc1"]["mean"] >= TARGET]
    chosen = min(passing, key=lambda n: found[n]["fit_and_test_s"]["mean"]) if passing else None
    return {"machine": machine(), "seeds": seeds, "candidates": found, "chosen": chosen}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# The default MNIST recipe: candidates judged on the validation split",
        "",
        f"Machine: {machine_line(result['machine'])}. Command: `python -m bench.mnist_recipe`: each candidate once per "
        f"seed ({', '.join(map(str, result['seeds']))}) through `app.command.main` in one process (imports and the "
        "first run's one-off costs paid once, in an untimed run before the others), "
        "followed by the test set on its last checkpoint. Rule: the fastest candidate whose mean validation accuracy "
        f"(5k held-out training images) is at least {TARGET:.1%}; test accuracy is reported, never used to choose.",
        "",
        "| candidate | fit + test (s), mean | val acc1: mean (min - max) | test acc1: mean (min - max) | steps "
        "| chosen |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in result["candidates"].items():
        val, test = c["val_acc1"], c["test_acc1"]
        lines.append(
            f"| {name} | {c['fit_and_test_s']['mean']:.1f} | {val['mean']:.2%} ({val['min']:.2%} - {val['max']:.2%}) | "
            f"{test['mean']:.2%} ({test['min']:.2%} - {test['max']:.2%}) | {c['runs'][0]['steps']} | "
            f"{'**chosen**' if name == result['chosen'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.mnist_recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 per candidate")
    parser.add_argument("--only", type=int, help="the first N candidates (a check of this script)")
    parser.add_argument("--smoke", action="store_true", help="a check: 1 candidate, 1 seed, 40 batches")
    parser.add_argument("--out", type=Path, help="folder for mnist_recipe.{json,md} (default bench/results)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    candidates = dict(list(CANDIDATES.items())[: 1 if args.smoke else args.only])
    if args.smoke:
        candidates = {name: [*change, "--trainer.limit_train_batches", "40"] for name, change in candidates.items()}
    result = run([0] if args.smoke else list(range(args.seeds)), candidates, warm_up=not args.smoke)
    save(args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else RESULTS), "mnist_recipe", result, markdown)
    return result


if __name__ == "__main__":
    main()
