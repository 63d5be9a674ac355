"""Faults, as a scheduler or a crash delivers them to real processes (``python cli.py fit`` in a new session).

- SIGTERM: every rank finishes its step, ``last.ckpt`` is written, the job exits with 143 and no traceback, and
  ``--ckpt_path last`` continues at the same global step (single process; a 2-process DDP job signalled as a whole,
  as a scheduler does; and the same job with only rank 1 signalled: all ranks stop together).
- SIGKILL while ``last.ckpt`` is being replaced (SIGTERM, then SIGKILL before the save ends: a short grace period):
  the previous ``last.ckpt`` is intact, loads, and is what the next run resumes from; the ``.partial`` left behind
  is ignored, and deleted by the next save of ``last.ckpt``.
- SIGKILL of one rank of a 2-process DDP job: the survivor exits with status 1 and the app's ``error: lost rank``
  line, well inside ``--launch.timeout`` (60 s), and no process of the job is left. Rank 1 (a child of the launcher)
  and rank 0 (the launcher itself).

A small callback (``Heartbeat``) tells the test each rank's pid and step and slows the steps down, so that the
signals land in the middle of training. The time from SIGKILL to the survivor's exit is printed (``pytest -s``).
Every job runs in its own process: a regression in the signal handling can fail a test, never end pytest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from app.resilience.sigterm import EXIT_CODE
from core.env import node_name
from tests.conftest import ROOT, short_fit
from tests.troubleshooting import assert_documented
from tools.resume_probe import children, loader_workers

pytestmark = pytest.mark.xdist_group("timing")  # its pass depends on wall-clock limits: never beside another such test

HEARTBEAT = "tests.distributed.test_faults.Heartbeat"
LAUNCH_TIMEOUT = 60  # --launch.timeout of the DDP jobs: a survivor must be out well before it
WELL_INSIDE = LAUNCH_TIMEOUT / 2


class Heartbeat(Callback):
    """Writes ``<pid> <global step> <first step of this process>`` to ``<default_root_dir>/heartbeat/rank<R>`` after
    each training step, then sleeps."""

    def __init__(self, sleep: float = 0.1) -> None:
        self.sleep = sleep
        self.first = None

    def on_train_batch_end(self, trainer, *args) -> None:
        folder = Path(trainer.default_root_dir) / "heartbeat"
        folder.mkdir(parents=True, exist_ok=True)
        self.first = trainer.global_step if self.first is None else self.first
        beat = f"{os.getpid()} {trainer.global_step} {self.first}"
        (folder / f"rank{trainer.global_rank}.tmp").write_text(beat)
        (folder / f"rank{trainer.global_rank}.tmp").replace(folder / f"rank{trainer.global_rank}")
        time.sleep(self.sleep)


class SigtermAtStep3(Heartbeat):
    """Sends SIGTERM to its own process at global step 3 (the single-process job signals itself)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        super().on_train_batch_end(trainer, *args)
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


class SlowToPickle:
    def __reduce__(self):
        time.sleep(600)  # the test kills the process long before
        return int, (0,)


class SlowSave(Callback):
    """Its checkpoint state takes minutes to pickle: a save of this run is in progress until the process dies."""

    def state_dict(self) -> dict:
        return {"slow": SlowToPickle()}


def args(root: Path, data_dir: Path, *extra: str) -> list[str]:
    return [
        "fit",
        *short_fit(root, data_dir, 40, 2, epochs=1000, batch_size=16),
        f"--trainer.callbacks+={HEARTBEAT}",
        *extra,
    ]


def start(root: Path, data_dir: Path, *extra: str, threads_at_exit: Path | None = None) -> subprocess.Popen:
    """``python cli.py fit ...`` in its own session (so the test can find and signal all of its processes);
    ``threads_at_exit``: each process writes the threads it still has at exit to ``<that path>.<pid>``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads_at_exit:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests/fixtures/threads_at_exit"), env.get("PYTHONPATH", "")])
        env["THREADS_AT_EXIT"] = str(threads_at_exit)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), *args(root, data_dir, *extra)], cwd=root.parent, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def beats(root: Path, ranks: int) -> list[tuple[int, int, int]] | None:
    """``(pid, step, first step)`` of each rank's latest heartbeat, or None until every rank has one."""
    found = [root / "heartbeat" / f"rank{r}" for r in range(ranks)]
    if not all(p.is_file() for p in found):
        return None
    return [tuple(int(x) for x in p.read_text().split()) for p in found]


def wait_for_step(job: subprocess.Popen, root: Path, ranks: int, step: int, timeout: float = 300) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = beats(root, ranks)
        if found and min(s for _, s, _ in found) >= step:
            return found
        if job.poll() is not None:
            break
        time.sleep(0.1)
    job.kill()
    raise AssertionError(f"no rank reached step {step} (exit {job.poll()}):\n{job.communicate()[0][-4000:]}")


def session(sid: int) -> list[int]:
    """Live processes of the session ``sid`` (the job's), from /proc: a process left behind shows up here."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def finish(job: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Waits for the job's output to close (every process that holds it, i.e. every rank, has exited)."""
    t0 = time.monotonic()
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the job did not end within {timeout} s:\n{job.communicate()[0][-4000:]}") from None
    return job.returncode, out, time.monotonic() - t0


def watch_stopped(threads_at_exit: Path, pid: int) -> None:
    """The rank that said the lost rank had stopped its hang watch when it exited (one left running may be inside a
    store call when the interpreter ends it: an abort, "terminate called without an active exception")."""
    written = Path(f"{threads_at_exit}.{pid}")
    if not written.exists():  # Lightning's poller saw the dead rank first: os._exit, no finalization to abort in
        return
    left = written.read_text().split()
    assert "hang-watch" not in left, left


def nothing_left(sid: int) -> None:
    deadline = time.monotonic() + 10
    while session(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session(sid)
    if left:
        os.killpg(sid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.slow
def test_sigterm_checkpoints_and_a_kill_during_the_next_save_keeps_it(mnist_dir, tmp_path):
    from app.command import main

    root = tmp_path / "run"
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    job = start(root, mnist_dir, "--trainer.callbacks+=tests.distributed.test_faults.SigtermAtStep3")
    code, out, _ = finish(job, timeout=300)
    saved = step_of(last)
    # signalled after step 3's boundary check (callback order): saved at the next boundary
    assert code == EXIT_CODE and saved == 4, (code, saved, out[-4000:])
    assert f"SIGTERM: saved {last} at global step 4; exiting with status 143." in out and "Traceback" not in out, out
    nothing_left(job.pid)

    # resumed, then SIGTERM again but SIGKILLed while last.ckpt is being replaced (the new state takes forever)
    (root / "heartbeat" / "rank0").unlink()
    job = start(root, mnist_dir, "--ckpt_path", "last", "--trainer.callbacks+=tests.distributed.test_faults.SlowSave")
    ((_, _, first),) = wait_for_step(job, root, ranks=1, step=saved + 1)
    assert first == saved + 1, (first, saved)  # continued at the step after the checkpoint's
    job.send_signal(signal.SIGTERM)
    partial = []
    deadline = time.monotonic() + 120
    while not partial and job.poll() is None and time.monotonic() < deadline:
        partial = list(last.parent.glob(".last.ckpt.*.partial"))
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    code, out, _ = finish(job, timeout=60)
    assert partial and code == -signal.SIGKILL, out[-4000:]
    assert step_of(last) == saved  # the previous checkpoint, intact and loadable

    # the next run resumes from it; the leftover .partial is ignored, and deleted when last.ckpt is saved again
    # (at the end of this epoch, cut short to 2 more steps)
    end = ["--trainer.limit_train_batches", str(saved + 2), "--trainer.max_epochs", "1"]
    resumed = main([*args(root, mnist_dir), *end, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == saved + 2
    assert step_of(last) == saved + 2 and not list(last.parent.glob("*.partial"))


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_sigterm_then_resume_then_a_killed_rank_is_named(mnist_dir, tmp_path):
    root = tmp_path / "run"
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", str(LAUNCH_TIMEOUT)]
    job = start(root, mnist_dir, *ddp)
    wait_for_step(job, root, ranks=2, step=2)
    os.killpg(job.pid, signal.SIGTERM)  # every process of the job, as a scheduler does
    code, out, _ = finish(job, timeout=120)
    assert code == EXIT_CODE and "SIGTERM: saved" in out and "Traceback" not in out, out[-4000:]
    nothing_left(job.pid)
    saved = step_of(root / "version_0" / "checkpoints" / "last.ckpt")

    for r in (0, 1):
        (root / "heartbeat" / f"rank{r}").unlink()
    job = start(root, mnist_dir, *ddp, "--ckpt_path", "last", threads_at_exit=tmp_path / "threads")
    beat = wait_for_step(job, root, ranks=2, step=saved + 2)
    assert [first for _, _, first in beat] == [saved + 1] * 2, (beat, saved)  # continued where it stopped
    rank1_pid = beat[1][0]
    os.kill(rank1_pid, signal.SIGKILL)
    code, out, seconds = finish(job, timeout=LAUNCH_TIMEOUT)
    said = [line for line in out.splitlines() if "lost rank" in line]
    print(f"\nrank 1 SIGKILLed: rank 0 exited {code} after {seconds:.1f} s: {said}")
    # whichever notices first, the failed collective or Lightning's launcher polling its children, says it this way
    assert code == 1 and len(said) == 1 and "Traceback" not in out, out[-4000:]
    assert said[0].startswith(f"error: lost rank 1 of 2 (on {node_name()}: rank 1 pid {rank1_pid} exit -9;"), said
    assert_documented(out, "lost-rank")  # ends with the link to its section, as docs/troubleshooting.md quotes it
    assert seconds < WELL_INSIDE, f"rank 0 took {seconds:.1f} s to exit; --launch.timeout is {LAUNCH_TIMEOUT} s"
    watch_stopped(tmp_path / "threads", job.pid)
    nothing_left(job.pid)


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_all_then_a_killed_launcher_rank0_is_named(mnist_dir, tmp_path):
    root = tmp_path / "run"
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", str(LAUNCH_TIMEOUT)]
    job = start(root, mnist_dir, *ddp)
    (rank0_pid, _, _), (rank1_pid, _, _) = wait_for_step(job, root, ranks=2, step=2)
    assert rank0_pid == job.pid  # Lightning's launcher: rank 0 is the process the user started
    os.kill(rank1_pid, signal.SIGTERM)  # one rank only: the ranks agree at the next step boundary, all stop
    code, out, _ = finish(job, timeout=120)
    saved = step_of(root / "version_0" / "checkpoints" / "last.ckpt")
    assert code == EXIT_CODE and "Traceback" not in out, out[-4000:]
    assert f"at global step {saved}; exiting with status 143." in out and saved >= 3, (saved, out[-4000:])
    nothing_left(job.pid)

    for r in (0, 1):
        (root / "heartbeat" / f"rank{r}").unlink()
    job = start(root, mnist_dir, *ddp, "--ckpt_path", "last")
    (rank0_pid, _, first), _ = wait_for_step(job, root, ranks=2, step=saved + 2)
    assert rank0_pid == job.pid and first == saved + 1
    job.kill()
    code, out, seconds = finish(job, timeout=LAUNCH_TIMEOUT)  # returns once rank 1 (same output) has exited too
    said = [line for line in out.splitlines() if "lost rank" in line]
    print(f"\nrank 0 SIGKILLed: rank 1 exited after {seconds:.1f} s: {said}")
    assert len(said) == 1 and "Traceback" not in out, out[-4000:]
    assert said[0].startswith("error: lost rank 0 of 2 (its process hosted the rendezvous store at 127.0.0.1:"), said
    assert "rank 1 stops too" in said[0], said
    assert_documented(out, "lost-rank")
    assert seconds < WELL_INSIDE, f"rank 1 took {seconds:.1f} s to exit; --launch.timeout is {LAUNCH_TIMEOUT} s"
    nothing_left(job.pid)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_loader_worker_is_one_line_naming_its_rank_pid_and_signal(mnist_dir, tmp_path):
    """The OOM killer's way: one DataLoader worker of rank 1 gets SIGKILL mid-epoch. Rank 1 says so in one line (its
    rank, the worker's pid, the signal, the likely cause and the fix), no traceback; the job exits 1, nothing is
    left, and the last checkpoint is intact."""
    root = tmp_path / "run"
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", str(LAUNCH_TIMEOUT)]
    threads = tmp_path / "threads"
    saves = ["--data.num_workers", "2", "--checkpoint.every_n_train_steps", "2"]
    job = start(root, mnist_dir, *ddp, *saves, threads_at_exit=threads)
    _, (rank1_pid, _, _) = wait_for_step(job, root, ranks=2, step=3)
    workers = loader_workers(rank1_pid)
    assert len(workers) >= 2, workers  # its training workers (and the validation's, which persist)
    os.kill(workers[0], signal.SIGKILL)
    code, out, seconds = finish(job, timeout=LAUNCH_TIMEOUT)
    print(f"\na loader worker of rank 1 SIGKILLed: the job exited {code} after {seconds:.1f} s")
    line = assert_documented(out, "loader-worker-lost")
    host = socket.gethostname()
    assert line.startswith(
        f"error: rank 1 (host {host}): its DataLoader worker (pid {workers[0]}) was killed by SIGKILL; "
    ), line
    assert code == 1 and "Traceback" not in out, out[-4000:]
    step_of(root / "version_0" / "checkpoints" / "last.ckpt")  # reads
    watch_stopped(threads, job.pid)  # rank 0, which said rank 1 was lost
    nothing_left(job.pid)


@pytest.mark.slow
@pytest.mark.distributed
def test_last_checkpoint_is_saved_on_the_wall_clock_interval_by_every_rank_at_the_same_step(mnist_dir, tmp_path):
    """``--checkpoint.interval_minutes``: a 2-process job saves ``last.ckpt`` mid-epoch, before any validation, each
    time rank 0's interval has passed (every rank saves at the end of the same step, or the save's barrier would wait
    for the launch timeout), keeps the one before as ``last.previous.ckpt``, and ends normally."""
    root = tmp_path / "run"
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", str(LAUNCH_TIMEOUT)]
    args = [*short_fit(root, mnist_dir, 16, 1, batch_size=16), f"--trainer.callbacks+={HEARTBEAT}", *ddp]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(ROOT / "cli.py"), "fit", *args, "--checkpoint.interval_minutes", "0.005"]
    job = subprocess.run(command, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    assert "checkpoint   last.ckpt every 0.005 min of training" in job.stdout + job.stderr
    folder = root / "version_0" / "checkpoints"
    assert step_of(folder / "last.ckpt") == 16
    assert 0 < step_of(folder / "last.previous.ckpt") < 16  # an interval save, mid-epoch (the epoch has 16 steps)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_while_the_job_starts_is_named_and_the_job_exits_1(mnist_dir, tmp_path):
    """Rank 1 SIGKILLed as soon as Lightning's launcher started it (before the process group formed): rank 0 names it
    in the app's one line and exits 1, instead of Lightning's SIGKILL of every rank (exit 137); nothing is left."""
    root = tmp_path / "run"
    job = start(root, mnist_dir, "--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", "60")
    deadline, rank1 = time.monotonic() + 120, None
    while rank1 is None and time.monotonic() < deadline and job.poll() is None:
        found = [p for p in children(job.pid) if b"cli.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        rank1 = found[0] if found else None
        time.sleep(0.02)
    assert rank1 is not None, job.communicate()[0][-3000:]
    os.kill(rank1, signal.SIGKILL)
    code, out, seconds = finish(job, timeout=LAUNCH_TIMEOUT)
    print(f"\nrank 1 SIGKILLed at its start: rank 0 exited {code} after {seconds:.1f} s")
    assert code == 1 and "Traceback" not in out and "Forcefully terminating" not in out, out[-4000:]
    said = assert_documented(out, "lost-rank")
    assert said.startswith(f"error: lost rank 1 of 2 (rank 1 pid {rank1} exit -9 while the job was starting"), said
    nothing_left(job.pid)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_leaves_no_loader_process_behind(mnist_dir, tmp_path):
    """A rank SIGKILLed (the OOM killer's way) while its DataLoader workers run: its forkserver and their workers, each
    holding a copy of the loader's imports (about 0.5 GB here), end with it instead of living on as orphans."""
    root = tmp_path / "run"
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--launch.timeout", str(LAUNCH_TIMEOUT)]
    job = start(root, mnist_dir, *ddp, "--data.num_workers", "1")
    _, (rank1_pid, _, _) = wait_for_step(job, root, ranks=2, step=3)
    assert loader_workers(rank1_pid), "rank 1 has no loader workers to leave behind"
    os.kill(rank1_pid, signal.SIGKILL)
    code, out, _ = finish(job, timeout=LAUNCH_TIMEOUT)
    assert code == 1 and "error: lost rank 1 of 2" in out, out[-4000:]
    nothing_left(job.pid)  # the job's session: rank 0, and what rank 1 started
