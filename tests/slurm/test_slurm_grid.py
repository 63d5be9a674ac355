"""A 2 x 2 grid as one job array on the throwaway SLURM cluster: ``python -m tools.slurm submit --grid``, one task
killed mid-run and requeued alone by its batch script (``--launch.max_restarts 1``), and ``python -m tools.slurm
results`` listing the four finished runs."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from app.checkpoint import last_checkpoint_of
from core.env import detect
from tests.slurm.conftest import ROOT, submit
from tests.wandb_reader import offline_runs, requires_wandb

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("timing")]

HOLD, HELD = 2, "held"  # the step after which the task the test kills waits for it, the file that says so


class HoldTheArraysOwnTask(Callback):
    """The task whose own job id is the array's (``scontrol`` takes that id for every task), first attempt: after step
    ``HOLD`` it saves ``last.ckpt`` (as the periodic save would), writes its process id to ``<run folder>/held`` and
    waits, up to 120 s, for the test to kill it."""

    def on_train_batch_end(self, trainer, *args) -> None:
        launch = detect()
        if trainer.global_step != HOLD or launch.slurm_job != launch.array_job or launch.restart_count:
            return
        last = last_checkpoint_of(trainer)
        trainer.save_checkpoint(last)
        deadline = time.monotonic() + 60
        while not last.is_file() and time.monotonic() < deadline:  # the save is atomic: there once it is whole
            time.sleep(0.05)
        Path(trainer.default_root_dir, HELD).write_text(str(os.getpid()))
        time.sleep(120)


def tasks_of(env: dict[str, str], job: str) -> dict[str, dict[str, str]]:
    """``scontrol show job`` of the array: task id -> its record (each task is a job of its own)."""
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    records = [dict(re.findall(r"(\w+)=(\S*)", block)) for block in out.split("\n\n") if "JobId=" in block]
    return {r["ArrayTaskId"]: r for r in records if "ArrayTaskId" in r}


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.25)


@requires_wandb
def test_a_2x2_grid_runs_as_one_array_with_one_task_requeued_alone(slurm_env, mnist_dir, tmp_path):
    root = tmp_path / "grid"
    env = {**{k: v for k, v in slurm_env.items() if not k.startswith("WANDB_")}, "WANDB_MODE": "offline"}
    job = submit(
        env, "--tasks-per-node", "1", "--time", "10:00", "--max-parallel", "2",
        "--grid", "model.optimizer.lr=0.01,0.001", "--grid", "data.batch_size=16,32",
        "--", "fit", "--config", str(ROOT / "configs" / "logger" / "wandb.yaml"), "--model.arch", "mnist_fast",
        "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(root), "--trainer.max_epochs", "2",
        "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar",
        "false", "--launch.max_restarts", "1", "--trainer.callbacks+=tests.slurm.test_slurm_grid.HoldTheArraysOwnTask",
    )  # fmt: skip
    script = next((root / "sbatch").glob("*.sh")).read_text()
    assert "#SBATCH --array=0-3%2" in script
    wait_for(lambda: any(p.read_text() for p in root.glob(f"*/{HELD}")), "a task holding at its step", 180)
    (held,) = root.glob(f"*/{HELD}")
    os.kill(int(held.read_text()), signal.SIGKILL)  # its rank dies: the batch script requeues this task
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
             .stdout.strip(), "the array leaving the queue", 300)  # fmt: skip

    tasks = tasks_of(env, job)
    logs = {t: (root / f"slurm-{job}_{t}.out").read_text() for t in "0123"}
    assert {t: r["JobState"] for t, r in tasks.items()} == dict.fromkeys("0123", "COMPLETED"), logs
    (killed,) = [t for t, r in tasks.items() if r["JobId"] == job]
    assert {t: r["Restarts"] for t, r in tasks.items()} == {t: str(int(t == killed)) for t in "0123"}  # alone
    assert logs[killed].count(f"array task {killed} of job") == 2, logs[killed]  # again with the same values
    assert "(SLURM requeue 1: the newest checkpoint of job" in logs[killed], logs[killed]  # resumed its last.ckpt

    out = subprocess.run([sys.executable, "-m", "tools.slurm", "results", str(root)], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and "4 of 4 finished" in out.stdout, out.stdout + out.stderr
    rows = list(csv.DictReader((root / "results.csv").open()))
    assert [(r["model.optimizer.lr"], r["data.batch_size"], r["epochs"], r["state"]) for r in rows] == [
        ("0.01", "16", "2", "finished"), ("0.01", "32", "2", "finished"),
        ("0.001", "16", "2", "finished"), ("0.001", "32", "2", "finished"),
    ]  # fmt: skip
    assert all(float(r["best val acc"]) > 0 for r in rows)
    # one W&B run per task (the requeued task's second attempt continues its run), all in the array job's group; the
    # group is read from each task's last attempt: the requeue killed the first before wandb flushed its run record
    runs = [offline_runs(root / r["folder"]) for r in rows]
    assert [len({run.run_id for run in attempts}) for attempts in runs] == [1, 1, 1, 1]
    assert len({attempts[0].run_id for attempts in runs}) == 4
    assert {attempts[-1].group for attempts in runs} == {f"slurm-array-{job}"}
