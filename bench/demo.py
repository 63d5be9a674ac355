"""What ``make demo`` costs and reaches: ``python -m bench.demo`` (about 2 minutes on 2 CPU cores).

Runs exactly the two commands of ``make demo`` in a temporary run folder, as a user would (separate processes, imports
included): ``python cli.py fit`` with the default config, then ``python cli.py test --ckpt_path last``, and reads back
what they printed and wrote: wall time of each command, the run's training summary (``summary.json``: best and last
``val/acc1``, mean images/s), the official 10k test-set accuracy, and the model summary's parameter and FLOP counts.
Writes ``results/demo.{json,md}``; the README quotes them. Arguments after ``--`` go to both commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, machine_line, write_json


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


def run(extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="demo-") as tmp:
        common = ["--trainer.default_root_dir", tmp, *extra]
        load_before = os.getloadavg()[0]
        fit_s, fit_out = timed(["fit", *common])
        test_s, test_out = timed(["test", "--ckpt_path", "last", *common])
        load_after = os.getloadavg()[0]
        summary = json.loads(next(Path(tmp).glob("version_*/summary.json")).read_text())
    return {
        "machine": machine(),
        "load_before_after": [round(load_before, 2), round(load_after, 2)],
        "commands": ["python cli.py fit", "python cli.py test --ckpt_path last"],
        "extra_args": extra,
        "fit_s": round(fit_s, 1),
        "test_s": round(test_s, 1),
        "summary": summary,
        "test_acc1": float(_number(r"test/acc1\W+([0-9.]+)", test_out)),
        "test_images": _number(r"test: evaluated (\d+/\d+) images", test_out),
        "params": _number(r"Total params:?\s+([0-9.]+ ?[KM]?)", fit_out).strip(),
        "flops_per_image": _number(r"Total FLOPs:?\s+([0-9.]+ ?[KMG]?)", fit_out).strip(),
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    before, after = result["load_before_after"]
    return "\n".join(
        [
            "# `make demo`: the default MNIST run",
            "",
            f"Machine: {machine_line(result['machine'])}. Load average (1 min) before / after: {before} / {after}.",
            f"Command: `python -m bench.demo{' -- ' + ' '.join(result['extra_args']) if result['extra_args'] else ''}`"
            " (runs `python cli.py fit`, then `python cli.py test --ckpt_path last`, in a temporary run folder).",
            "",
            "| what | value |",
            "|---|---|",
            f"| `python cli.py fit` wall time (imports included) | {result['fit_s']} s |",
            f"| `python cli.py test --ckpt_path last` wall time | {result['test_s']} s |",
            f"| official test set accuracy (`test/acc1`, {result['test_images']} images) | {result['test_acc1']:.2%} |",
            f"| best / last `val/acc1` (5k held-out training images) | {s['best val/acc1']:.2%} / "
            f"{s['last val/acc1']:.2%} |",
            f"| epochs, optimizer steps | {s['epochs']}, {s['steps']} |",
            f"| mean training images/s | {s['mean images/s (global)']:,.0f} |",
            f"| model: parameters, FLOPs per image (forward, model summary) | {result['params']}, "
            f"{result['flops_per_image']} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for demo.{json,md} (default bench/results)")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    result = run(extra)
    write_json(args.out / "demo.json", result)
    (args.out / "demo.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
