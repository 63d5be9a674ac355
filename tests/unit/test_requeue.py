"""After a fault, a SLURM job under ``--launch.max_restarts K`` requeues itself (``app.resilience.requeue``): one rank
of the attempt acts, and says what happened in one line. The requeue itself, on the throwaway cluster:
tests/slurm/test_slurm_jobs.py::test_your_own_sbatch_script_with_requeue_is_requeued_by_the_app_after_each_fault."""

from __future__ import annotations

import pytest

from app.resilience.requeue import Requeue
from core.env import detect


def job(restarts: int, **extra: str):
    """The launch record of task 0 of SLURM job 4242 after ``restarts`` requeues."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    return detect({**env, "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1", **extra})


@pytest.fixture
def slurm_job(tmp_path):
    return tmp_path / "run"


def test_no_requeue_left_is_one_error_line_from_one_rank(slurm_job, capsys):
    requeue, other_rank = Requeue(), Requeue()
    requeue.arm(2, slurm_job, job(2))
    other_rank.arm(2, slurm_job, job(2, SLURM_PROCID="1"))
    requeue.after_fault()
    other_rank.after_fault()  # a second rank of the same attempt: silent
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: SLURM: the fault above ends job 4242 and no requeue is left (2 of 2 used, "), line
    assert line.endswith("#restarts-used-up"), line


def test_a_requeue_that_cannot_be_made_says_why_and_names_the_fix(slurm_job, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a node without scontrol
    requeue = Requeue()
    requeue.arm(1, slurm_job, job(0))
    requeue.after_fault()
    # the requeue's line comes first (scontrol's requeue ends the step at once: a line after it could be lost)
    said, line = capsys.readouterr().err.splitlines()
    assert said.startswith("SLURM: requeue 1 of 1 (scontrol requeue 4242, --launch.max_restarts)"), said
    assert line.startswith("error: SLURM: scontrol requeue 4242 failed (") and "#SBATCH --requeue" in line, line


def test_the_batch_script_of_tools_slurm_requeues_by_itself_and_plain_runs_never(slurm_job, capsys):
    requeue = Requeue()
    requeue.arm(1, slurm_job, job(5, DPTRAIN_REQUEUE_BY="script"))
    assert not requeue.armed
    requeue.arm(0, slurm_job, job(5))  # --launch.max_restarts 0 (the default)
    assert not requeue.armed
    requeue.after_fault()
    assert capsys.readouterr().err == ""
