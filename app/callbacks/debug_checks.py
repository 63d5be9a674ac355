"""``--launch.debug true``: the preset for a bad day. torch's and NCCL's own checks and logs, a short hang timeout,
and two checks of the app's own on what most often makes DDP jobs hang or fail at an epoch's end:

- at each epoch's start every rank must have the same number of training batches (a rank with fewer leaves the epoch
  early and the others wait for it in a collective: torchtitan #1618, pytorch #53979);
- on each logging step every rank must have logged the same metric keys (a key logged on one rank only makes
  ``sync_dist`` and the epoch-end reduction wait for a collective the other ranks never start: Lightning #21409).

A failed check ends every rank with status 1 and one message naming the ranks and the difference. Each check is one
``all_gather_object`` over gloo, on those steps only (the preset is for finding a bug, not for speed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from app.collectives import gloo_side_group
from app.logging_steps import is_logging_step

DEBUG_HANG_TIMEOUT = 120.0  # seconds: the hang watch's timeout under --launch.debug (unless set lower)


def debug_env(folder: Path, backend: str = "nccl") -> dict[str, str]:
    """The variables ``--launch.debug`` sets (a user's own values win): torch's collective checks (``DETAIL``: every
    collective's shapes and order compared across ranks, costly) and NCCL's log, one file per host and process in
    ``folder``. On gloo torch's level is ``INFO``: with ``DETAIL`` a 2-process gloo ``cli.py fit`` of this app ends
    with a segmentation fault of rank 0 right after the process group forms (torch 2.14.1, CPU; not investigated
    further), and the other rank then waits for it."""
    return {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL" if backend == "nccl" else "INFO",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": str(folder / "nccl.%h.%p.log"),  # NCCL expands %h (host) and %p (pid)
    }


def apply_debug(folder: Path, backend: str, environ: Any = os.environ) -> dict[str, str]:
    """Sets :func:`debug_env` (before the process group exists: torch and NCCL read them when it is made); returns
    the variables set."""
    made = {k: v for k, v in debug_env(folder, backend).items() if k not in environ}
    environ.update(made)
    folder.mkdir(parents=True, exist_ok=True)
    return made


class DebugCheckError(SystemExit):
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
                f"error: --launch.debug: the ranks have different numbers of training batches in epoch "
                f"{trainer.current_epoch} ({ranks}); the ranks with fewer would leave the epoch early and the others "
                "hang in a collective. Fix: give every rank the same number of batches (a DistributedSampler, "
                "drop_last, the same limit_train_batches on every rank)."
            )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not self._distributed(trainer) or not is_logging_step(trainer):
            return
        keys = self._gather(trainer, sorted(trainer._results.keys()))  # private: the keys this rank logged so far
        union = set().union(*keys)
        missing = {r: sorted(union - set(k)) for r, k in enumerate(keys) if set(k) != union}
        if missing:
            lacks = "; ".join(f"rank {r} lacks {', '.join(m)}" for r, m in missing.items())
            raise DebugCheckError(
                f"error: --launch.debug: the ranks logged different metric keys by step {trainer.global_step} "
                f"({lacks}); a key logged on some ranks only makes sync_dist and the epoch-end reduction wait for a "
                "collective the others never start. Fix: call self.log with the same keys on every rank."
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._group = None

    def __deepcopy__(self, memo: dict) -> DebugChecks:
        return DebugChecks()
