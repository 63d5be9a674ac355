"""Why the test suite sets ``OMP_WAIT_POLICY=PASSIVE`` (``tests/__init__.py``): MNIST fits as the suite's two workers
run them on this machine's cores, with GNU OpenMP's default wait (a thread done with its share of an operation spins
before it sleeps) and with ``PASSIVE`` (it sleeps at once): two fits at once, one fit beside a core kept busy by
another process (a single-threaded loop), and one fit alone.

``python -m bench.omp_wait`` (about 6 minutes on 2 CPU cores): ``--rounds`` rounds, the two policies alternating in
each. Writes ``results/omp_wait.{json,md}``: the seconds of each and the ratio passive / default, per round; the
file's first line is the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, machine, machine_line, save

POLICIES = {"default": None, "PASSIVE": "PASSIVE"}
CASES = {"two fits at once": (2, False), "one fit beside a busy core": (1, True), "one fit alone": (1, False)}


def fit_args(data_dir: str, root: Path, batches: int) -> list[str]:
    return [
        sys.executable, str(ROOT / "cli.py"), "fit", "--data.data_dir", data_dir, "--trainer.default_root_dir",
        str(root), "--trainer.max_epochs", "1", "--trainer.limit_train_batches", str(batches),
        "--trainer.limit_val_batches", "5", "--trainer.enable_progress_bar", "false", "--data.num_workers", "0",
        "--model.arch", "mnist_cnn",
    ]  # fmt: skip


def fits_at_once(n: int, policy: str | None, data_dir: str, batches: int, busy: bool = False) -> float:
    """Seconds until ``n`` fits started together have all ended, each with ``OMP_WAIT_POLICY`` = ``policy``; with
    ``busy``, beside a process that keeps one core busy."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        return _timed(n, env, data_dir, batches)
    finally:
        if burner:
            burner.kill()
            burner.wait()


def _timed(n: int, env: dict, data_dir: str, batches: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        jobs = [
            subprocess.Popen(fit_args(data_dir, Path(tmp) / str(i), batches), cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(n)
        ]  # fmt: skip
        for job in jobs:
            _, err = job.communicate()
            if job.returncode:
                raise RuntimeError(f"a fit failed:\n{err[-3000:]}")
        return time.perf_counter() - start


def markdown(result: dict) -> str:
    """The medians on the first line (docs/development.md includes it), then each round."""
    rows, medians = result["rows"], result["median_ratio"]
    lines = [
        "Time with PASSIVE / with the default wait, median: "
        + ", ".join(f"{case} {ratio:.2f}" for case, ratio in medians.items())
        + f". Machine: {machine_line(result['machine'])}. Command: `python -m bench.omp_wait --rounds "
        f"{1 + max(r['round'] for r in rows)}`.",
        "", "| case | round | default s | PASSIVE s | PASSIVE / default |", "|---|---|---|---|---|",
        *(f"| {r['case']} | {r['round']} | {r['default']:.1f} | {r['PASSIVE']:.1f} | {r['ratio']:.2f} |" for r in rows),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.omp_wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=str(ROOT / "data"), help="MNIST folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=60, help="training batches per fit")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    for round_ in range(args.rounds):
        for case, (n, busy) in CASES.items():
            seconds = {
                name: fits_at_once(n, policy, args.data_dir, args.batches, busy) for name, policy in POLICIES.items()
            }
            rows.append({"round": round_, "case": case, **seconds, "ratio": seconds["PASSIVE"] / seconds["default"]})
            print(rows[-1], flush=True)
    medians = {case: statistics.median(r["ratio"] for r in rows if r["case"] == case) for case in CASES}
    result = {"machine": machine(), "batches": args.batches, "rows": rows, "median_ratio": medians}
    save(Path(args.out), "omp_wait", result, markdown)
    return result


if __name__ == "__main__":
    main()
