"""Shared fixtures: real MNIST (fetched once into the repo's data/ cache), the CLI runner, RunIf-style skips."""

from __future__ import annotations

import ast
import functools
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only

from tools.dev_extras import use_dev_extras

ROOT = Path(__file__).resolve().parent.parent
# matplotlib and scipy for the tests that read them in this process (a PNG's pixels, a devkit's meta.mat); after
# Lightning's import above, so that torchmetrics, in here as in every process the tests start, imports neither
use_dev_extras()
DATA_DIR = Path(os.environ.get("MNIST_DATA_DIR", ROOT / "data"))


# handlers the app's callbacks install (SIGTERMCheckpoint, SLURMRequeue) and Lightning's signal connector
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2]


@pytest.fixture(autouse=True)
def _global_state_restored():
    """In-process ``main()`` changes process-wide state; each test gets back what it started with: the environment
    variables, the signal handlers, every logger's level (Lightning and tools lower them) and torch's default dtype.
    (The step agreement of ``app.resilience.agree`` is the Trainer's, so a test's Trainer takes it along.)
    """
    environ = dict(os.environ)  # Lightning's launcher and process-group set-up export MASTER_*, NODE_RANK, LOCAL_RANK
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    named = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(lg for lg in named if isinstance(lg, logging.Logger))]
    levels = {lg: lg.level for lg in loggers}
    dtype = torch.get_default_dtype()  # `*-true` precisions set it while building the model
    # a Trainer built for rank 1 in this process (LOCAL_RANK=1) sets the rank that rank_zero_* functions, Lightning's
    # loggers and the plan obey: left so, every later test in this worker would log nothing
    rank = getattr(rank_zero_only, "rank", None)
    yield
    if rank is not None:
        rank_zero_only.rank = rank
    torch.set_default_dtype(dtype)
    for s, handler in handlers.items():
        if signal.getsignal(s) != handler and handler is not None:
            signal.signal(s, handler)
    for lg, level in levels.items():
        lg.setLevel(level)
    if os.environ != environ:  # a later job started by this worker must not inherit LOCAL_RANK=0 (no rank 1 then)
        os.environ.clear()
        os.environ.update(environ)


# --- Two test workers (make test: pytest -n 2) ------------------------------------------------------------------------
# pytest-xdist's --dist loadgroup does not group under pytest 9 (the worker's "nodeid@group" rewrite no longer reaches
# the scheduler), so the groups are read here, in the controller, from each test module's own `pytestmark`: a module
# marked pytest.mark.xdist_group("NAME") runs in that group, on one worker, one test after the other; any other module
# is a group of its own, so its module-scoped fixtures are built once. Groups: "timing" (tests whose pass depends on
# a wall-clock limit: never two at once), "parity" (the modules sharing the session's parity job: built once).


@functools.cache
def xdist_group_of(module: Path) -> str:
    """The xdist group of a test module: its module-level ``pytest.mark.xdist_group("NAME")``, else the module."""
    try:
        tree = ast.parse(module.read_text())
    except (OSError, SyntaxError):
        return str(module)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "xdist_group" and call.args:
                    return str(ast.literal_eval(call.args[0]))
    return str(module)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scope scheduling (a scope goes to one worker whole) with the scopes above."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(ROOT / nodeid.split("::", 1)[0])

    return ByGroup(config, log)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """A folder with the four real MNIST files, fetched through the app's own code path if missing."""
    from datamodules.mnist import ensure_mnist

    return ensure_mnist(DATA_DIR)


def short_fit(
    root: Path,
    data_dir: str | Path,
    train_batches: int,
    val_batches: int,
    epochs: int = 1,
    batch_size: int | None = None,
) -> list[str]:
    """The ``cli.py fit`` arguments the tests repeat: a short run on the CPU of the data in ``data_dir`` into ``root``,
    ``train_batches`` and ``val_batches`` per epoch, without progress bar or model summary (add the subcommand and
    what is particular to the test)."""
    args = [
        "--trainer.default_root_dir", str(root), "--data.data_dir", str(data_dir),
        "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", str(train_batches),
        "--trainer.limit_val_batches", str(val_batches), "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip
    return args + (["--data.batch_size", str(batch_size)] if batch_size else [])


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Runs ``python cli.py ARGS`` as a user would, returning the CompletedProcess (output captured as text)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A TCP port that nothing listens on now, for a rendezvous the test's processes bind later.

    Chosen at random below the kernel's ephemeral range: a port the kernel just handed out (``bind(0)``) is the one it
    may hand out again as the source port of any outgoing connection before the job binds it. What is left (another
    process binding this very port meanwhile) shows as ``port_taken`` in the job's output: run it again then.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in 20000..{low}")


def port_taken(output: str) -> bool:
    """Whether a job failed because its rendezvous port was in use (c10d's EADDRINUSE)."""
    return re.search(r"EADDRINUSE|address already in use", output, re.IGNORECASE) is not None


def fast_trainer(tmp_path, **kwargs):
    """A real Trainer on CPU for a few batches, without logger, checkpoints or progress bar (override any argument)."""
    from lightning.pytorch import Trainer

    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=2, limit_test_batches=2,
        limit_predict_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


def run_if(cuda: int = 1) -> pytest.MarkDecorator:
    """The one annotation a hardware test needs: ``@run_if(cuda=2)`` (or ``pytestmark = run_if(cuda=2)``) marks it
    ``gpu`` and skips it with a readable reason unless that many CUDA devices exist (:func:`pytest_runtest_setup`)."""
    return pytest.mark.gpu(cuda=cuda)


def requires_cuda(n: int = 1) -> pytest.MarkDecorator:
    """:func:`run_if` under its former name."""
    return run_if(cuda=n)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``gpu`` test (``run_if``, or a bare ``pytest.mark.gpu``: one device) is skipped, saying why, without CUDA."""
    needs = [mark.kwargs.get("cuda", 1) for mark in item.iter_markers("gpu")]
    have = torch.cuda.device_count()
    if needs and have < max(needs):
        pytest.skip(f"needs {max(needs)} CUDA device(s), found {have}")
