"""How much room checkpoints take: their size from the model before any exists, and a warning when the run folder's
disk has room for too few (the atomic save needs a second copy next to the one it replaces)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from app.checkpoint.files import megabytes
from app.lightning_private import PATH


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a checkpoint (nested dicts, lists, tuples): nearly all of its size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def checkpoint_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes of a checkpoint of ``model`` trained with ``optimizer``, before any exists: the weights and
    buffers, plus the optimizer's state per weight (Adam-like optimizers keep two tensors, the others at most one)."""
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    slots = 2 if optimizer is not None and "adam" in type(optimizer).__name__.lower() else 1
    return weights * (1 + slots) + sum(t.numel() * t.element_size() for t in model.buffers())


def low_disk_space(folder: PATH, estimate: int, room_for: int = 3) -> str | None:
    """A warning when ``folder`` (or its nearest existing parent) has room for fewer than ``room_for`` checkpoints
    of ``estimate`` bytes (the atomic save needs a second copy next to the one it replaces), else None."""
    where = Path(folder).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free >= room_for * estimate:
        return None
    return (
        f"warning: preflight: {where} has {megabytes(free)} free, room for {free / estimate:.1f} checkpoints of "
        f"about {megabytes(estimate)} (estimated from the model and the optimizer); a save that finds the disk full "
        f"stops the run. Fix: free space there, or set --trainer.default_root_dir to a disk with room for "
        f"{room_for} or more."
    )
