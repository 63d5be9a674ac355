"""Ctrl-C in a real terminal (a pseudo-terminal: the line discipline sends SIGINT to the job's whole foreground process
group, both ranks and their loader workers, as a terminal does) during a 2-process ``ddp`` fit.

Once: every rank says it stops at the step boundary, the checkpoint is saved, every rank prints where and how to
resume, the job exits 130 and nothing of it is left running. Twice: every rank says it stops at once, without saving.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("timing")  # its pass depends on wall-clock limits: never beside another such test

ROOT = Path(__file__).resolve().parents[2]


def _fit_args(root: Path, data_dir: Path, workers: int, pause: float = 0.0) -> list[str]:
    return [
        sys.executable, str(ROOT / "cli.py"), "fit", "--trainer.default_root_dir", str(root), "--data.data_dir",
        str(data_dir), "--data.batch_size", "8", "--data.num_workers", str(workers), "--model.arch", "mnist_cnn",
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "400", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--launch.timeout", "120",
        "--trainer.callbacks+=tools.resume_probe.SampleLog", f"--trainer.callbacks.folder={root}",
        f"--trainer.callbacks.pause={pause}",
    ]  # fmt: skip


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1] == str(sid)]


def run_in_terminal(args: list[str], root: Path, presses: int, timeout: float = 240) -> tuple[int, str, list[str]]:
    """Runs ``args`` on a new pseudo-terminal; once rank 0 trained 3 batches, types Ctrl-C ``presses`` times.

    The second press comes once both ranks said they stop (signals typed back to back would merge into one).
    Returns the exit status (negative: ended by that signal), the terminal's output and the job's processes still
    running 15 s after it ended."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: session leader with the pseudo-terminal as its controlling terminal
        os.chdir(ROOT)
        os.execve(args[0], args, env)
    output, pressed, deadline = b"", 0, time.monotonic() + timeout
    samples = root / "samples_rank0.jsonl"
    status = None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other side is closed, the job has ended
                chunk = b""
            if not chunk:
                break
            output += chunk
        if not pressed and samples.exists() and len(samples.read_text().splitlines()) >= 3:
            os.write(fd, b"\x03")  # what the terminal sends for Ctrl-C
            pressed = 1
        if pressed == 1 < presses and output.count(b"Ctrl-C: stopping at the end") == 2:
            os.write(fd, b"\x03")
            pressed = 2
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    code = os.waitstatus_to_exitcode(status)
    left: list[str] = []
    for _ in range(30):  # loader workers notice a parent that is gone within a few seconds
        left = _session_processes(pid)
        if not left:
            break
        time.sleep(0.5)
    assert pressed == presses, output.decode(errors="replace")[-3000:]
    # the terminal echoes ^C in front of the next line
    return code, output.decode(errors="replace").replace("\r\n", "\n").replace("^C", ""), left


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_once_saves_and_says_how_to_resume_on_every_rank(mnist_dir, tmp_path):
    code, out, left = run_in_terminal(_fit_args(tmp_path, mnist_dir, workers=2), tmp_path, presses=1)
    assert code == 130, out[-3000:]
    for rank in (0, 1):
        stopping = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] Ctrl-C: stopping at the end")]
        saved = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] Ctrl-C: saved ")]
        assert len(stopping) == 1 and len(saved) == 1, out[-3000:]
        assert "Resume with the same command plus `--ckpt_path last`" in saved[0]
    assert "Traceback" not in out and "exited unexpectedly" not in out, out[-3000:]
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert not left, left


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_twice_stops_at_once_on_every_rank(mnist_dir, tmp_path):
    code, out, left = run_in_terminal(_fit_args(tmp_path, mnist_dir, workers=0, pause=1.5), tmp_path, presses=2)
    assert code in (-2, 130), out[-3000:]  # ended by SIGINT itself
    for rank in (0, 1):
        again = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] Ctrl-C again: stopping now")]
        assert len(again) == 1, out[-3000:]
    assert "Ctrl-C: saved" not in out and "Traceback" not in out, out[-3000:]
    assert not left, left
