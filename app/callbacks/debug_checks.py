"""``--launch.debug true``: the preset for a bad day. torch's and NCCL's own checks and logs (:func:`apply_debug`),
each rank's in a file of its own (:func:`capture_rank_logs`), a short hang timeout, and two checks of the app's own
on what most often makes DDP jobs hang or fail at an epoch's end:

- at each epoch's start every rank must have the same number of training batches (a rank with fewer leaves the epoch
  early and the others wait for it in a collective: torchtitan #1618, pytorch #53979);
- on each logging step every rank must have logged the same metric keys (a key logged on one rank only makes
  ``sync_dist`` and the epoch-end reduction wait for a collective the other ranks never start: Lightning #21409).

A failed check ends every rank with status 1 and one message naming the ranks and the difference. Each check is one
``all_gather_object`` over gloo, on those steps only (the preset is for finding a bug, not for speed).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from app.collectives import gloo_side_group
from app.lightning_private import ddp_kwargs, logged_keys, strategy_timeout
from core.env import export_unset
from core.errors import UserError
from core.logging_steps import is_logging_step

DEBUG_HANG_TIMEOUT = 120.0  # seconds: the hang watch's timeout under --launch.debug (unless set lower)


def debug_env(folder: Path) -> dict[str, str]:
    """The variables ``--launch.debug`` sets (a user's own values win): torch's collective checks (``DETAIL``: every
    collective's op, shapes and order compared across ranks before it runs, costly), c10d's C++ log at ``INFO``, and
    NCCL's log, one file per host and process in ``folder`` (NCCL expands ``%h`` and ``%p`` itself)."""
    return {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_CPP_LOG_LEVEL": "INFO",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": str(folder / "nccl.%h.%p.log"),
    }


def apply_debug(folder: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Sets :func:`debug_env` before the process group exists (in ``environ``, default the process's environment);
    returns the variables set.

    ``TORCH_CPP_LOG_LEVEL`` is read only when a process starts, so it reaches the ranks Lightning's launcher starts
    after this, not rank 0, nor the ranks of a torchrun or srun job: export it for them before the launch."""
    made = export_unset(debug_env(folder), environ)
    folder.mkdir(parents=True, exist_ok=True)
    return made


def rank_log(folder: Path, rank: int) -> Path:
    """The debug log of ``rank``: everything torch's distributed tooling writes in that process."""
    return folder / f"rank{rank}.log"


def capture_rank_logs(strategy: Any, folder: Path) -> None:
    """Sends what c10d writes for each rank to that rank's :func:`rank_log`, from just before its process group forms.

    c10d writes its C++ messages (``DETAIL``'s checks, DDP's set-up and timings, gloo's) to file descriptor 2 and its
    Python ones through the ``torch.distributed`` loggers. Lightning's launcher has nothing like torchrun's
    ``--log-dir``/``--redirects``, so by hand: fd 2 becomes the rank's file and Python's ``sys.stderr`` (the app's
    messages, Lightning's log, tracebacks) moves to a copy of the old fd 2, the terminal. Done as the strategy sets up
    its environment: after Lightning's launcher started the other ranks (they would inherit rank 0's fd 2).
    """
    setup_environment = strategy.setup_environment

    def with_rank_log() -> None:
        many = strategy.world_size > 1
        if many:
            _redirect_fd2(rank_log(folder, strategy.global_rank), strategy.global_rank)
            # torch read TORCH_DISTRIBUTED_DEBUG when torch.distributed was imported, maybe before apply_debug set it
            dist.set_debug_level_from_env()
        setup_environment()
        if many and dist.get_debug_level() == dist.DebugLevel.DETAIL:
            _ddp_outside_the_wrapper(strategy)

    strategy.setup_environment = with_rank_log  # this run's strategy only (an instance attribute)


def _redirect_fd2(path: Path, rank: int) -> None:
    old = sys.stderr
    old.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding=old.encoding, errors="backslashreplace")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = terminal
    for handler in _handlers():  # Lightning's own log handler holds the old sys.stderr (fd 2 now: the file)
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(terminal)
    # torch's loggers (torch._logging: each with its own stderr handler, not propagating) write INFO to the file only
    to_file = logging.FileHandler(path)  # appends, as fd 2 does: the lines interleave, none is lost
    to_file.setFormatter(logging.Formatter(f"[rank{rank}]:%(levelname).1s%(asctime)s %(name)s] %(message)s"))
    logging.getLogger("torch.distributed").setLevel(logging.INFO)
    for name, log in _named():
        if name == "torch.distributed" or (name.startswith("torch.distributed.") and not log.propagate):
            for handler in log.handlers:
                handler.setLevel(max(handler.level, logging.WARNING))
            log.addHandler(to_file)


def _named() -> list[tuple[str, logging.Logger]]:
    return [(n, lg) for n, lg in list(logging.Logger.manager.loggerDict.items()) if isinstance(lg, logging.Logger)]


def _handlers() -> list[logging.Handler]:
    return [h for lg in (logging.getLogger(), *(lg for _, lg in _named())) for h in lg.handlers]


def _ddp_outside_the_wrapper(strategy: Any) -> None:
    """torch 2.14.1's DDP constructor segfaults on a gloo process group made under ``DETAIL``
    (``c10d::Logger::set_env_variables`` casts the group's gloo backend to ``ProcessGroupGloo`` and reads its thread
    count, but ``DETAIL`` made it a ``ProcessGroupWrapper``; reproducer: ``tools/gloo_detail_ddp.py``).
    So on gloo DDP gets a gloo group of its own made without the wrapper: its gradient all-reduces are not checked,
    every other collective (Lightning's, ``sync_dist``, the app's) still is."""
    kwargs = ddp_kwargs(strategy)
    if kwargs is None or "process_group" in kwargs or dist.get_backend() != "gloo":
        return
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        kwargs["process_group"] = dist.new_group(backend="gloo", timeout=strategy_timeout(strategy))
    finally:
        dist.set_debug_level(dist.DebugLevel.DETAIL)


class DebugCheckError(UserError):
    """The ranks disagree on something they must agree on; raised on every rank with the same message."""


class DebugChecks(Callback):
    """The two checks of ``--launch.debug`` (see the module); a no-op in a single-process run."""

    def _gather(self, trainer: Trainer, value: Any) -> list[Any]:
        everyone: list[Any] = [None] * trainer.world_size
        self._group = gloo_side_group(getattr(self, "_group", None))
        dist.all_gather_object(everyone, value, group=self._group)
        return everyone

    @staticmethod
    def _distributed(trainer: Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._distributed(trainer):
            return
        counts = self._gather(trainer, trainer.num_training_batches)
        if len(set(counts)) > 1:
            ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise DebugCheckError(
                f"--launch.debug: the ranks have different numbers of training batches in epoch "
                f"{trainer.current_epoch} ({ranks}); the ranks with fewer would leave the epoch early and the others "
                "hang in a collective. Fix: give every rank the same number of batches (a DistributedSampler, "
                "drop_last, the same limit_train_batches on every rank)."
            )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not self._distributed(trainer) or not is_logging_step(trainer):
            return
        keys = self._gather(trainer, logged_keys(trainer))
        union = set().union(*keys)
        missing = {r: sorted(union - set(k)) for r, k in enumerate(keys) if set(k) != union}
        if missing:
            lacks = "; ".join(f"rank {r} lacks {', '.join(m)}" for r, m in missing.items())
            raise DebugCheckError(
                f"--launch.debug: the ranks logged different metric keys by step {trainer.global_step} "
                f"({lacks}); a key logged on some ranks only makes sync_dist and the epoch-end reduction wait for a "
                "collective the others never start. Fix: call self.log with the same keys on every rank."
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._group = None

    def __deepcopy__(self, memo: dict) -> DebugChecks:
        return DebugChecks()
