"""Data wait of a 2-process ``ddp`` MNIST fit: resident (a batch is one indexing) against the DataLoader's path.

``python -m bench.resident`` (about 2 minutes on 2 CPU cores) runs, one after the other on the same machine, the
default recipe as ``python cli.py fit --trainer.devices 2 --trainer.strategy ddp --trainer.accelerator cpu``
(Lightning's launcher, gloo), one epoch, with ``--data.resident true`` and with ``--data.resident false`` (the
per-sample path, batches stacked in the training process, as before), and reads each rank's step time and data
wait and Lightning's loop between steps (shares of its whole step, measured by ``app.callbacks.Stragglers``) from the
run's ``summary.json``, beside the whole step of the run (global batch / global images/s). Writes
``results/resident.{json,md,png}``. ``--smoke``: 10 batches (a check of this script;
results in runs/bench-smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.common import RESULTS, ROOT, figure, machine, machine_line, save
from bench.demo import timed

DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
PATHS = {"resident": ["--data.resident", "true"], "loader": ["--data.resident", "false"]}


def one(path: str, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"resident-{path}-") as tmp:
        load = os.getloadavg()[0]
        seconds, _ = timed(["fit", *DDP, *PATHS[path], "--trainer.default_root_dir", tmp, *extra])
        summary = json.loads(next(Path(tmp).glob("version_*/summary.json")).read_text())
        config = yaml.safe_load(next(Path(tmp).glob("version_*/config.yaml")).read_text())
    global_batch = config["data"]["init_args"]["batch_size"] * summary["world size"]
    step_ms = 1000 * global_batch / summary["mean images/s (global)"]  # the whole step: compute, collectives, data
    for r in summary["per rank"]:  # the summary's shares are of each rank's whole step (its own clock)
        r["data_wait_ms"] = r["whole_step_ms"] * r["data_wait_frac"]
        r["loop_ms"] = r["whole_step_ms"] * r["loop_frac"]
        r["data_wait_of_step"] = r["data_wait_ms"] / step_ms
    return {
        "step_ms": step_ms,
        "wall_s": round(seconds, 1),
        "load_before": round(load, 2),
        "images_per_s": summary["mean images/s (global)"],
        "best_val_acc1": summary["best val/acc1"],
        "per_rank": summary["per rank"],
    }


def markdown(result: dict[str, Any]) -> str:
    extra = " -- " + " ".join(result["extra_args"]) if result["extra_args"] else ""
    lines = [
        "# Data wait of a 2-process `ddp` MNIST fit: resident against the DataLoader",
        "",
        f"Machine: {machine_line(result['machine'])}. Command: `python -m bench.resident{extra}`: `python cli.py fit "
        f"{' '.join(DDP)}` with `--data.resident true`, then `false`, one epoch of the default recipe each.",
        "",
        "Data wait: from the moment the training loop asks the loader for the next batch to the start of the step "
        "(fetch and transfer); loop: the rest of the gap between two steps (Lightning's loop: hooks, logging). The "
        "training summary gives both as shares of each rank's whole step (`summary`); the last column divides the "
        "data wait by the run's whole step (global batch / global images/s).",
        "",
        "| path | rank | whole step (ms) | own (ms) | data wait (ms) | loop (ms) | summary: data wait | summary: loop "
        "| data wait, % of the run's step | images/s (global) | fit wall time (s) | load before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, run in result["paths"].items():
        for r in run["per_rank"]:
            lines.append(
                f"| {path} | {r['rank']} | {run['step_ms']:.1f} | {r['step_ms']:.1f} | {r['data_wait_ms']:.2f} | "
                f"{r['loop_ms']:.2f} | {r['data_wait_frac']:.1%} | {r['loop_frac']:.1%} | {r['data_wait_of_step']:.1%} "
                f"| {run['images_per_s']:,.0f} | {run['wall_s']} | {run['load_before']} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, figsize=(6.4, 3.2)) as (_, ax):
        labels, waits, steps = [], [], []
        for name, run in result["paths"].items():
            for r in run["per_rank"]:
                labels.append(f"{name}\nrank {r['rank']}")
                waits.append(100 * r["data_wait_of_step"])
                steps.append(r["data_wait_ms"])
        bars = ax.bar(labels, waits, color=["tab:green" if "resident" in label else "tab:grey" for label in labels])
        for bar, ms in zip(bars, steps, strict=True):
            ax.annotate(f"{ms:.1f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
        ax.set_ylabel("data wait (% of the whole step)")
        ax.set_title("2-process ddp MNIST fit (CPU, gloo): resident vs DataLoader")
        ax.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.resident", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for resident.{json,md} (default bench/results)")
    parser.add_argument("--smoke", action="store_true", help="10 training batches per run")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.smoke:
        extra = ["--trainer.limit_train_batches", "10", "--trainer.limit_val_batches", "2", *extra]
    out = args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else RESULTS)
    result = {"machine": machine(), "extra_args": extra, "paths": {p: one(p, extra) for p in PATHS}}
    save(out, "resident", result, markdown, plot)
    return result


if __name__ == "__main__":
    main()
