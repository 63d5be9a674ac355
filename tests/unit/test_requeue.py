"""After a fault, a SLURM job under ``--launch.max_restarts K`` requeues itself (``app.launch.requeue``): one rank of
the attempt acts, and says what happened in one line. The requeue itself, on the throwaway cluster:
tests/slurm/test_slurm_jobs.py::test_your_own_sbatch_script_with_requeue_is_requeued_by_the_app_after_each_fault."""

from __future__ import annotations

import pytest

from app.launch import requeue


@pytest.fixture
def slurm_job(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv(requeue.SCRIPT_OWNS, raising=False)
    yield tmp_path / "run"
    requeue.arm(0, tmp_path)  # disarmed for the tests that follow


def test_no_requeue_left_is_one_error_line_from_one_rank(slurm_job, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    requeue.arm(2, slurm_job)
    requeue.after_fault()
    requeue.after_fault()  # a second rank of the same attempt: silent
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: SLURM: the fault above ends job 4242 and no requeue is left (2 of 2 used, "), line
    assert line.endswith("#restarts-used-up"), line


def test_a_requeue_that_cannot_be_made_says_why_and_names_the_fix(slurm_job, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("PATH", str(tmp_path))  # a node without scontrol
    requeue.arm(1, slurm_job)
    requeue.after_fault()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: SLURM: scontrol requeue 4242 failed (") and "#SBATCH --requeue" in line, line


def test_the_batch_script_of_tools_slurm_requeues_by_itself_and_plain_runs_never(slurm_job, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    monkeypatch.setenv(requeue.SCRIPT_OWNS, "script")
    requeue.arm(1, slurm_job)
    assert not requeue.armed()
    monkeypatch.delenv(requeue.SCRIPT_OWNS)
    requeue.arm(0, slurm_job)  # --launch.max_restarts 0 (the default)
    assert not requeue.armed()
    requeue.after_fault()
    assert capsys.readouterr().err == ""
