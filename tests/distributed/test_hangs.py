"""A rank that stays alive but stops making progress (``app.resilience.hang_watch``), on real 2-process gloo jobs.

Three stuck ranks, as users meet them: asleep in Python (Lightning's launcher), waiting in a collective the other
rank never enters (torchrun), SIGSTOPped (Lightning's launcher). Each time rank 0 prints one diagnosis naming rank 1
with its place (or "does not answer"), every process of the job ends within ``--launch.hang_timeout`` + 15 s with a
non-zero status, the stacks files exist, and ``last.ckpt`` still loads. A run with a checkpoint save and a validation
each longer than the hang timeout is not stopped. The detection times are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from datamodules import MNISTDataModule
from tests.conftest import ROOT
from tests.distributed.test_faults import args, nothing_left, start, wait_for_step
from tests.troubleshooting import assert_documented

pytestmark = pytest.mark.xdist_group("timing")  # its pass depends on wall-clock limits: never beside another such test

HANG = 8  # --launch.hang_timeout of these jobs
GRACE = 15  # every process must be gone within HANG + GRACE of the stall
STUCK_AT = 6  # the global step after which rank 1 gets stuck
HERE = "tests.distributed.test_hangs"


class SleepOnRank1(Callback):
    """Rank 1 sleeps (in Python) after step STUCK_AT, for far longer than the test."""

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 1 and trainer.global_step == STUCK_AT:
            Path(trainer.default_root_dir, "stalled").write_text(str(time.time()))
            time.sleep(3600)


class LoneCollective(Callback):
    """After step STUCK_AT, rank 1 enters an all_reduce on a group that rank 0 never uses again."""

    def setup(self, trainer, pl_module, stage) -> None:
        self.group = dist.new_group(backend="gloo")  # collective: every rank makes it

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 1 and trainer.global_step == STUCK_AT:
            Path(trainer.default_root_dir, "stalled").write_text(str(time.time()))
            dist.all_reduce(torch.ones(1), group=self.group)


class SlowSaveAndValidation(Callback):
    """The first checkpoint save (rank 0) and the first validation (rank 1's steps, while rank 0 waits for it at the
    validation's end) each take longer than the hang timeout: legitimate pauses, which must not stop the job."""

    def __init__(self) -> None:
        self.saved = self.validated = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 0 and not self.saved:
            self.saved = True
            time.sleep(HANG + 3)

    def on_validation_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 1 and not trainer.sanity_checking and trainer.current_epoch == 0:
            time.sleep((HANG + 3) / 3)  # x 3 batches


class SlowSetupMNIST(MNISTDataModule):
    """Rank 1's DataModule ``setup`` does not return (as on a file system that stopped answering)."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.trainer is not None and self.trainer.global_rank == 1:
            time.sleep(3600)


def ddp(*extra: str, hang: float = HANG) -> list[str]:
    """2 ranks; epochs of 4 steps, so ``last.ckpt`` exists (step 4) when rank 1 gets stuck at STUCK_AT."""
    epoch = ["--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "3"]  # (these win over args()')
    return ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.hang_timeout", str(hang), *epoch, *extra]


def diagnosis(out: str) -> list[str]:
    assert_documented(out, "hang-watch")  # its first line, as docs/troubleshooting.md quotes it, with the link
    lines = out.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("error: hang watch: rank 1 of 2 is stuck")]
    assert len(first) == 1, out[-6000:]
    end = next(i for i in range(first[0], len(lines)) if lines[i].startswith("Every rank now exits"))
    return lines[first[0] : end + 1]


def check_ended(job, root: Path, out: str, code: int, stalled_at: float, ended_at: float, what: str,
                step: int | None = STUCK_AT) -> str:  # fmt: skip
    said = diagnosis(out)
    text = "\n".join(said)
    print(f"\n{what}: diagnosis {stalled_at:.1f} s after the stall, last process gone after {ended_at:.1f} s\n{text}")
    assert code != 0 and ended_at < HANG + GRACE, (code, ended_at, out[-4000:])
    rank1 = next(line for line in said if line.startswith("  rank 1 (host"))
    assert "rank 0 (host" in text and rank1.endswith("<- behind"), text
    if step is not None:  # rank 1 is stuck in the end hooks of step STUCK_AT; rank 0 waits in the next one
        assert f"last finished step {step - 1}, in step {step}" in rank1, text
        assert f"last finished step {step}, in step {step + 1}" in text, text
    assert "stacks-rank<R>.txt" in text, text
    # gloo records its collectives too (torch 2.14): rank 0 dumped its flight recorder for torchfrtrace
    assert "Flight recorder (each rank's last collectives): " in text and list(root.rglob("nccl_trace_rank_0")), text
    assert "--ckpt_path last" in text and "--launch.hang_timeout SECONDS" in text, text
    nothing_left(job.pid)
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 4  # intact, loadable
    return text


def stall_time(root: Path) -> float:
    return float((root / "stalled").read_text())


def run_until_done(job) -> tuple[int, str, float, float | None]:
    """Reads the job's output as it comes: (exit status, output, time the last process was gone, time the
    diagnosis's first line arrived)."""
    lines, seen = [], None
    deadline = time.monotonic() + HANG + 300
    for line in job.stdout:
        lines.append(line)
        if seen is None and line.startswith("error: hang watch: rank"):
            seen = time.time()
        if time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            break
    job.wait(timeout=60)
    return job.returncode, "".join(lines), time.time(), seen


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_asleep_in_python_is_named_with_its_frames(mnist_dir, tmp_path):
    root = tmp_path / "run"
    job = start(root, mnist_dir, *ddp(f"--trainer.callbacks+={HERE}.SleepOnRank1"))
    code, out, gone, seen = run_until_done(job)
    stalled = stall_time(root)
    text = check_ended(job, root, out, code, seen - stalled, gone - stalled, "rank 1 asleep")
    assert "tests/distributed/test_hangs.py:" in text and "on_train_batch_end" in text, text
    stacks = root / "version_0" / "hang" / "stacks-rank1.txt"
    assert "in on_train_batch_end" in stacks.read_text(), stacks.read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_long_save_and_validation_pass_then_a_sigstopped_rank_does_not_answer(mnist_dir, tmp_path):
    root = tmp_path / "run"
    job = start(root, mnist_dir, *ddp(f"--trainer.callbacks+={HERE}.SlowSaveAndValidation"))
    (_, _, _), (rank1_pid, _, _) = wait_for_step(job, root, ranks=2, step=STUCK_AT)
    os.kill(rank1_pid, signal.SIGSTOP)
    stalled = time.time()
    (root / "stalled").write_text(str(stalled))
    code, out, gone, seen = run_until_done(job)
    text = check_ended(job, root, out, code, seen - stalled, gone - stalled, "rank 1 SIGSTOPped", step=None)
    assert "does not answer" in text, text


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_rank_in_a_lone_collective_is_named(mnist_dir, tmp_path):
    root = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(ROOT / "cli.py"), *args(root, mnist_dir, *ddp(f"--trainer.callbacks+={HERE}.LoneCollective"))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    code, out, gone, seen = run_until_done(job)
    stalled = stall_time(root)
    text = check_ended(job, root, out, code, seen - stalled, gone - stalled, "torchrun: rank 1 in a lone collective")
    assert "all_reduce" in text and "on_train_batch_end" in text, text


def starting(out: str, allowance: float) -> list[str]:
    """The diagnosis of a rank stuck while the job starts: the start-up allowance in its first line."""
    said = diagnosis(out)
    assert f"(--launch.startup_timeout {allowance:g}: the job is starting)." in said[0], out[-6000:]
    return said


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("hook", ["setup", "on_train_start"])
def test_a_rank_stuck_while_the_job_starts_is_named_with_where(mnist_dir, tmp_path, hook):
    """Rank 1 asleep in its DataModule's ``setup`` (before its hang watch starts) or in ``on_train_start`` (after the
    sanity check): named within ``--launch.startup_timeout``, with where it is, and the job ends. Before, neither was
    watched: the job waited for the 30-minute collective timeout."""
    root, allowance = tmp_path / "run", 6
    probe = ["--trainer.callbacks+=tools.resume_probe.HangIn", "--trainer.callbacks.hook", hook]
    if hook == "setup":
        probe = ["--data.class_path", f"{HERE}.SlowSetupMNIST"]
    job = start(root, mnist_dir, *ddp(*probe, "--launch.startup_timeout", str(allowance)))
    began = time.time()
    code, out, gone, seen = run_until_done(job)
    said = starting(out, allowance)
    text = "\n".join(said)
    print(f"\nrank 1 asleep in {hook}: diagnosis {seen - began:.1f} s after the job began\n{text}")
    assert code != 0 and seen is not None, out[-4000:]
    rank1 = next(line for line in said if line.startswith("  rank 1"))
    assert rank1.endswith("<- behind"), text
    if hook == "setup":
        assert rank1.startswith("  rank 1: never started its hang watch: still in the DataModule's setup"), text
    else:
        assert "starting training: before the end of its first step" in rank1, text
        assert "tools/resume_probe.py:" in text and "_maybe" in text, text
    assert "--launch.startup_timeout SECONDS" in text, text
    nothing_left(job.pid)
