"""After a fault, a SLURM job under ``--launch.max_restarts K`` requeues itself (``app.resilience.requeue``): one rank
of the attempt records the fault in the run dir and acts, and says what happened in one line; K counts faults, not
the requeues of a preemption or of the wall time. The requeue itself, on the throwaway cluster:
tests/slurm/test_slurm_jobs.py::test_your_own_sbatch_script_with_requeue_is_requeued_by_the_app_after_each_fault."""

from __future__ import annotations

import json

import pytest

from app.resilience.faults import HangError, LostRankError
from app.resilience.requeue import Requeue, faults_of
from core.env import detect


def job(restarts: int, **extra: str):
    """The launch record of task 0 of SLURM job 4242 after ``restarts`` requeues."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    return detect({**env, "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1", **extra})


@pytest.fixture
def slurm_job(tmp_path):
    return tmp_path / "run"


def test_no_requeue_left_is_one_error_line_from_one_rank(slurm_job, capsys):
    for attempt, fault in ((1, LostRankError), (2, HangError)):  # two faults of this job: the budget of 2 is used
        earlier = Requeue()
        earlier.arm(2, slurm_job, job(attempt - 1, DPTRAIN_REQUEUE_BY="script"))
        earlier.after_fault(fault)
    requeue, other_rank = Requeue(), Requeue()
    requeue.arm(2, slurm_job, job(2))
    other_rank.arm(2, slurm_job, job(2, SLURM_PROCID="1"))
    requeue.after_fault(HangError("stuck"))
    other_rank.after_fault(HangError("stuck"))  # a second rank of the same attempt: silent, records nothing
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "error: SLURM: the fault above ends job 4242 and no requeue is left (fault 3, 2 of 2 used, "
        "--launch.max_restarts; 0 requeues by time or preemption before it), so the job fails."
    ), line
    assert line.endswith("#restarts-used-up"), line
    assert [(f["attempt"], f["kind"]) for f in faults_of(slurm_job, "4242")] == [
        (1, "lost-rank"), (2, "hang-watch"), (3, "hang-watch")
    ]  # fmt: skip


def test_requeues_by_preemption_or_wall_time_leave_the_budget_whole(slurm_job, monkeypatch, capsys, tmp_path):
    """Three requeues from outside (a preemption, Lightning's SIGUSR1 before the wall time) record no fault: the
    first fault of the fourth attempt is fault 1 of 2, and its record says where it happened."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here: the requeue's line, then why it failed
    requeue = Requeue()
    monkeypatch.setenv("SLURMD_NODENAME", "n7")  # SLURM's name of this node, which the record names
    requeue.arm(2, slurm_job, job(3))
    requeue.after_fault(LostRankError("lost rank 1"))
    said = capsys.readouterr().err.splitlines()[0]
    assert said.startswith(
        "SLURM: requeue 4 (scontrol requeue 4242): fault 1 of 2 (--launch.max_restarts); 3 requeues by time or "
        "preemption before it. The job goes back in the queue"
    ), said
    (record,) = [json.loads(line) for line in (slurm_job / "faults.jsonl").read_text().splitlines()]
    assert record == {"job": "4242", "attempt": 4, "kind": "lost-rank", "step": None, "node": "n7"}


def test_a_requeue_that_cannot_be_made_says_why_and_names_the_fix(slurm_job, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a node without scontrol
    requeue = Requeue()
    requeue.arm(1, slurm_job, job(0))
    requeue.after_fault()
    # the requeue's line comes first (scontrol's requeue ends the step at once: a line after it could be lost)
    said, line = capsys.readouterr().err.splitlines()
    assert said.startswith("SLURM: requeue 1 (scontrol requeue 4242): fault 1 of 1 (--launch.max_restarts); 0 "), said
    assert line.startswith("error: SLURM: scontrol requeue 4242 failed (") and "#SBATCH --requeue" in line, line


def test_the_batch_script_of_tools_slurm_requeues_by_itself_and_plain_runs_never(slurm_job, capsys):
    requeue = Requeue()
    requeue.arm(1, slurm_job, job(5, DPTRAIN_REQUEUE_BY="script"))
    assert not requeue.armed
    requeue.after_fault(HangError)  # recorded for the script's count, said by the script
    assert capsys.readouterr().err == "" and len(faults_of(slurm_job, "4242")) == 1
    requeue.arm(0, slurm_job, job(5))  # --launch.max_restarts 0 (the default)
    assert not requeue.armed
    requeue.after_fault()
    assert capsys.readouterr().err == "" and len(faults_of(slurm_job, "4242")) == 1
