"""A grid of runs as one SLURM job array: ``--grid KEY=V1,V2`` of ``python -m tools.slurm submit``, and the table
``python -m tools.slurm results RUN_ROOT`` gathers from its run folders.

The grid root (the command's ``--trainer.default_root_dir``) holds ``grid.json`` (written at submit: each task's
values and run folder, and the array job's id), the tasks' logs ``slurm-JOB_TASK.out``, one run folder per task and,
once ``results`` ran, ``results.csv``. What a task did is read from what the app writes anyway: ``summary.json``
(:class:`app.callbacks.summary.TrainingSummary`, at the end of a fit) and the TensorBoard event files' start times.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from core.errors import UsageError, report
from tools.sbatch import Job

MAX_ARRAY_SIZE = 1001  # SLURM's default MaxArraySize: task ids 0 to 1000
MANIFEST, TABLE = "grid.json", "results.csv"


def stop(message: str) -> None:
    """One ``error:`` line and exit status 2 (a command line to fix, as argparse's)."""
    report(UsageError(message, help="slurm-submit"))
    sys.exit(2)


def parse(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["model.optimizer.lr=0.1,0.01", ...]`` as ``[("model.optimizer.lr", ["0.1", "0.01"]), ...]``; a missing ``=``,
    an empty value or a key given twice is one line and exit 2."""
    grid: list[tuple[str, list[str]]] = []
    for item in items:
        key, equals, values = item.partition("=")
        key = key.strip().removeprefix("--")
        parts = [value.strip() for value in values.split(",")]
        if not equals or not key or "" in parts:
            stop(f"--grid {item!r} needs KEY=V1,V2,... with no empty value, e.g. --grid model.optimizer.lr=0.1,0.01")
        if key in (k for k, _ in grid):
            stop(f"--grid {key} is given twice; give all of its values in one: --grid {key}=V1,V2")
        grid.append((key, parts))
    return grid


def max_array_size() -> int:
    """The cluster's ``MaxArraySize`` (``scontrol show config``); SLURM's default where scontrol does not say."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return MAX_ARRAY_SIZE
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.MULTILINE)
    return int(found.group(1)) if found else MAX_ARRAY_SIZE


def check_size(job: Job) -> None:
    """A grid of more tasks than the cluster takes in one array is one line, before anything is parsed."""
    count, limit = len(job.tasks()), max_array_size()
    if count > limit:
        stop(f"the grid has {count} tasks but this cluster's MaxArraySize is {limit} (scontrol show config): "
             "split it into several submits, one value list each")  # fmt: skip


def first_values(job: Job) -> list[str]:
    """The first task's options: the command is checked with them (unknown keys, invalid values) at submit."""
    return job.tasks()[0][1] if job.grid else []


def write_manifest(job: Job, job_id: str) -> None:
    """``grid.json`` in the grid root: what ``results`` reads back."""
    keys = [key for key, _ in job.grid]
    tasks = [
        {"task": i, "folder": folder, "values": dict(zip(keys, args[1::2], strict=True))}
        for i, (folder, args) in enumerate(job.tasks())
    ]
    manifest = {"job": job_id, "keys": keys, "tasks": tasks}
    (Path(job.run_dir) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def grid_root(name: str) -> Path:
    """``RUN_ROOT`` as given, or ``runs/NAME``."""
    for root in (Path(name), Path("runs") / name):
        if (root / MANIFEST).is_file():
            return root
    stop(f"no grid in {name!r} nor in runs/{name} (no {MANIFEST}): give the --trainer.default_root_dir of a "
         "`python -m tools.slurm submit --grid` job")  # fmt: skip
    raise AssertionError  # stop() exits


def queued(job_id: str) -> dict[str, str]:
    """The array's tasks still in SLURM's queue: task id -> state (``running``, ``pending``); empty without squeue."""
    if not job_id or not shutil.which("squeue"):
        return {}
    out = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%K %T"], capture_output=True, text=True)
    return dict(line.lower().split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)


def task_row(root: Path, task: dict, queue: dict[str, str], squeue: bool) -> dict[str, object]:
    """One task's values, epochs, best validation accuracy, time and state, from its run folder."""
    folder = root / task["folder"]
    summaries = sorted(folder.glob("version_*/summary.json"), key=lambda p: p.stat().st_mtime)
    summary = json.loads(summaries[-1].read_text()) if summaries else {}
    starts = [float(p.name.split(".")[3]) for p in folder.glob("version_*/events.out.tfevents.*")]
    end = summaries[-1].stat().st_mtime if summaries else time.time()
    best = next((v for k, v in summary.items() if k.startswith("best ")), None)
    state = "finished" if summaries else queue.get(str(task["task"])) or ("failed" if squeue else "unknown")
    return {
        "task": task["task"],
        **task["values"],
        "epochs": summary.get("epochs", ""),
        "best val acc": "" if best is None else f"{best:.4f}",
        "time_s": f"{end - min(starts):.0f}" if starts and state in ("finished", "running") else "",
        "state": state,
        "folder": task["folder"],
    }


def results(name: str) -> list[dict[str, object]]:
    """Prints the grid's table and writes it to ``results.csv`` in the grid root."""
    root = grid_root(name)
    manifest = json.loads((root / MANIFEST).read_text())
    queue = queued(manifest.get("job", ""))
    rows = [task_row(root, task, queue, shutil.which("squeue") is not None) for task in manifest["tasks"]]
    with open(root / TABLE, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    done = sum(r["state"] == "finished" for r in rows)
    print(f"{done} of {len(rows)} finished; written to {root / TABLE}")
    return rows
