"""Data wait of a 2-process ``ddp`` MNIST fit: resident (a batch is one indexing) against the DataLoader's path.

``python -m bench.resident`` (about 2 minutes on 2 CPU cores) runs, one after the other on the same machine, the
default recipe as ``python cli.py fit --trainer.devices 2 --trainer.strategy ddp --trainer.accelerator cpu``
(Lightning's launcher, gloo), one epoch, with ``--data.resident true`` and with ``--data.resident false`` (the
per-sample path, batches stacked in the training process, as before), and reads each rank's step time and data
wait (the share of its own time spent waiting for the next batch, measured by ``app.callbacks.Stragglers``) from the
run's ``summary.json``.
Writes ``results/resident.{json,md}``. ``--smoke``: 10 batches (a check of this script; results in runs/bench-smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, machine_line, write_json
from bench.demo import timed

DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
PATHS = {"resident": ["--data.resident", "true"], "loader": ["--data.resident", "false"]}


def one(path: str, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"resident-{path}-") as tmp:
        load = os.getloadavg()[0]
        seconds, _ = timed(["fit", *DDP, *PATHS[path], "--trainer.default_root_dir", tmp, *extra])
        summary = json.loads(next(Path(tmp).glob("version_*/summary.json")).read_text())
    return {
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
        "| path | rank | step (ms) | data wait (% of the step) | images/s (global) | fit wall time (s) | load before |",
        "|---|---|---|---|---|---|---|",
    ]
    for path, run in result["paths"].items():
        for r in run["per_rank"]:
            lines.append(
                f"| {path} | {r['rank']} | {r['step_ms']:.1f} | {100 * r['data_wait_frac']:.1f}% | "
                f"{run['images_per_s']:,.0f} | {run['wall_s']} | {run['load_before']} |"
            )
    return "\n".join(lines) + "\n"


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
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "resident.json", result)
    (out / "resident.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
