"""Saving in the background (``--checkpoint.background``): Lightning's ``AsyncCheckpointIO`` around the atomic save,
so the saves made during training are written by a thread while training goes on."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from app.lightning_private import PATH


class BackgroundSaves(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` around :class:`AtomicCheckpointIO`: a save made while :attr:`deferring`
    (the periodic saves during training, :class:`app.callbacks.SaveSchedule`) is written by a thread while
    training goes on; every other save (the end of fit, a signal's) is waited for.

    Lightning's version clones every tensor on its own device (a second copy of the weights and optimizer state in
    GPU memory) and reports a failed save only at the next one without waiting for it; here the snapshot goes to
    host memory, at most one save is in flight (the next save and the teardown wait for it first; a removal runs
    after it), and a failure (a full disk: :class:`~app.checkpoint.DiskFullError`) is raised there on rank 0,
    where :class:`app.trainer.Trainer` shares it with every rank.
    """

    def __init__(self, checkpoint_io: CheckpointIO) -> None:  # the run's AtomicCheckpointIO
        super().__init__(checkpoint_io)
        self.deferring = False
        self._pending = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        self.wait()
        snapshot = apply_to_collection(checkpoint, torch.Tensor, _to_host)  # the state as of now, on the host
        self._ensure_setup()
        self._pending = self._executor.submit(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options)
        if not self.deferring:
            self.wait()

    def wait(self) -> None:
        """Until the save in flight (if any) is on disk; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def remove_checkpoint(self, path: PATH) -> None:
        """Queued behind the save in flight (Lightning removes the previous best file right after saving the new
        one, on rank 0 alone): training goes on, and a failed save keeps the older file and is raised at the next
        save on rank 0 as any failed save (raised here, rank 0 would stop alone)."""
        save = self._pending
        if save is None:
            return super().remove_checkpoint(path)
        self._pending = self._executor.submit(self._remove_after, save, path)

    def _remove_after(self, save: Any, path: PATH) -> None:
        save.result()  # done (one thread, in order); a failure raises here and the file is not removed
        self.checkpoint_io.remove_checkpoint(path)

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            super().teardown()


def atomic_io(io: Any) -> Any:
    """The run's checkpoint I/O under the background wrapper, if any."""
    return io.checkpoint_io if isinstance(io, BackgroundSaves) else io


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
