"""A run that finished its work exits 0 on every rank, every time.

Before the fix, about one 2-process fit in six ended with "terminate called without an active exception" and
SIGABRT after its training summary: a gloo worker thread freed a finished collective's tensors while Python was
finalizing (see ``app.launch.group``). Here: the mechanism (no gloo thread left once ``main`` returns, on a completed
run and on the error path). The race is intermittent, so one green run proves nothing: every 2-process ``cli.py`` job
of the suite must end cleanly (dozens: each asserts its exit status), and the docs' runnable blocks, which include
completed 2-process fits under Lightning's launcher, torchrun and the old launcher, fail on a "terminate called" in
their output (``tests/e2e/test_docs_commands.py``). Tens of runs in a row: ``bash tools/exit_soak.sh 50`` (``50
lost-rank``: rank 1 SIGKILLed, rank 0 must exit 1 with its line, not abort). Under torchrun every rank's exit status
reaches the launcher's own; under Lightning's launcher rank 1 is a child of rank 0 whose status is lost, so there the
output is the witness (libstdc++ prints "terminate called" before aborting).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from tests.conftest import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def gloo_threads() -> int:
    """This process's gloo worker threads (torch names them ``pt_gloo_runloop``)."""
    tasks = Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())


def test_the_process_group_is_gone_when_main_returns(mnist_dir, tmp_path):
    """The mechanism itself, on both ranks: once ``cli.py`` has run, no gloo worker thread is left that could still
    free a collective's tensors while the interpreter finalizes (see ``app.launch.group``)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "tests.distributed.test_clean_exit", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--data.data_dir", str(mnist_dir),
        "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert sorted(re.findall(r"rank (\d) gloo threads during the run: (\d+), after main: (\d+)", said)) == [
        ("0", "2", "0"),
        ("1", "2", "0"),
    ], said[-4000:]


def test_a_rank_that_ends_on_a_lost_peer_leaves_no_gloo_thread_behind(mnist_dir, tmp_path):
    """The same on the error path: rank 1 SIGKILLed mid-epoch, rank 0's collective fails, it says the lost rank and
    exits 1; its group is ended before the interpreter finalizes (else the same race turned that exit 1 into SIGABRT,
    "terminate called without an active exception", after the error line). Lightning's launcher: rank 0 is this
    probe, rank 1 its child running ``cli.py``."""
    command = [
        sys.executable, "-m", "tests.distributed.test_clean_exit", "fit", "--trainer.devices", "2",
        "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar",
        "false", "--data.data_dir", str(mnist_dir), "--data.batch_size", "16", "--trainer.default_root_dir",
        str(tmp_path), "--trainer.callbacks+=tools.resume_probe.SignalAt", "--trainer.callbacks.step", "3",
        "--trainer.callbacks.rank", "1", "--trainer.callbacks.sigkill", "true",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-4000:]
    assert [line for line in said.splitlines() if line.startswith("error: lost rank 1 of 2")], said[-4000:]
    probe = re.findall(r"rank (\d) gloo threads during the run: \S+, after main: (\d+)", said)
    assert probe == [("0", "0")], said[-4000:]
    assert "terminate called" not in said, said[-4000:]


class _Probe(Callback):
    during: int | None = None  # read back after the run (the instance is built by the CLI)

    def on_train_end(self, trainer, pl_module) -> None:
        _Probe.during = gloo_threads()


if __name__ == "__main__":  # one rank of the probe job above: `python cli.py ARGS` as its own __main__
    import runpy

    sys.argv = [str(ROOT / "cli.py"), *sys.argv[1:], "--trainer.callbacks+", "tests.distributed.test_clean_exit._Probe"]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exiting:  # the error path: its line said, the process ends with this status
        code = exiting.code
    from tests.distributed.test_clean_exit import _Probe as Probe  # the class the CLI imported (not __main__'s)

    rank = os.environ.get("RANK", "0")  # Lightning's launcher sets no RANK in the process it starts from
    print(f"rank {rank} gloo threads during the run: {Probe.during}, after main: {gloo_threads()}", flush=True)
    sys.exit(code)
