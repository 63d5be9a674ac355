"""The hang watch under srun: a 2-task job whose rank 1 falls asleep is named, fails, and leaves nothing running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.distributed.test_hangs import GRACE, HANG, STUCK_AT
from tests.slurm.conftest import submit, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("timing")]


def processes_of(root: Path) -> list[int]:
    """Live processes whose command line names this job's run folder (a rank left behind shows up here)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(root) in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_rank_asleep_under_srun_is_named_and_the_job_fails(slurm_env, mnist_dir, tmp_path):
    args = [
        "fit", "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(tmp_path),
        "--trainer.max_epochs", "1000", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false", "--launch.hang_timeout", str(HANG), "--data.batch_size", "16",
        "--trainer.callbacks+=tests.distributed.test_hangs.SleepOnRank1",
    ]  # fmt: skip
    job = submit(slurm_env, "--tasks-per-node", "2", "--time", "10:00", "--", *args)
    info = wait_job(slurm_env, job)
    left = time.time()
    log = (tmp_path / f"slurm-{job}.out").read_text()
    stalled = float((tmp_path / "stalled").read_text())
    print(f"\nSLURM: rank 1 asleep; the job left the queue {left - stalled:.1f} s after the stall (polled every 0.5 s)")
    assert info["JobState"] == "FAILED", log[-4000:]
    assert "error: hang watch: rank 1 of 2 is stuck" in log and f"in step {STUCK_AT}; now at  <- behind" in log, log
    assert left - stalled < HANG + GRACE, log[-4000:]
    assert processes_of(tmp_path) == []
