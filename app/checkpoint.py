"""Checkpoints that survive crashes and resume exactly.

- :class:`AtomicCheckpointIO`: rank 0 (the strategy calls it there only; all ranks then wait at Lightning's barrier)
  streams the checkpoint into a temporary file next to the target, fsyncs it and ``os.replace``-s it over the target,
  so a crash during a save never leaves a truncated ``last.ckpt``. Loading maps tensors to the calling rank's own
  device and uses ``weights_only=True`` unless the checkpoint needs more.
- :class:`RNGState`: Lightning's checkpoints hold model, optimizer, schedulers, GradScaler, loops and callbacks but
  not the random generators, so shuffling and dropout after a resume would differ from an uninterrupted run. This
  callback stores every rank's generator states and restores them on resume.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn


def own_device() -> torch.device:
    """The device this process computes on: its current CUDA device (set by Lightning per rank), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local saves and rank-local, ``weights_only`` loads.

    Lightning's own save serialises the whole checkpoint into memory first and relies on fsspec's transaction to
    move it into place; this one streams to disk (no second in-memory copy of a large checkpoint), fsyncs, and
    renames in the same folder, which is atomic on POSIX. Remote URLs (``s3://``...) are left to Lightning.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # make the rename itself durable (not possible on every filesystem)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Loads onto this rank's own device (never every rank onto GPU 0).

        ``weights_only=None`` tries the safe loader first and falls back to full unpickling, with a warning, only
        for checkpoints that hold arbitrary Python objects; ``True`` or ``False`` are obeyed as given.
        """
        map_location = map_location if map_location is not None else own_device()
        if weights_only is not None:
            return pl_load(path, map_location=map_location, weights_only=weights_only)
        try:
            return pl_load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            rank_zero_warn(
                f"{path} holds objects that the safe loader refuses ({str(err).splitlines()[0][:200]}); loading it "
                "with weights_only=False. Only do this with checkpoints you trust."
            )
            return pl_load(path, map_location=map_location, weights_only=False)


def _local_rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        # numpy's state as tensors and numbers, so the checkpoint stays loadable with weights_only=True
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
            "kind": kind,
        },  # fmt: skip
        "python": random.getstate(),
    }


def _set_local_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


class RNGState(Callback):
    """Saves every rank's torch/CUDA/numpy/python random states in checkpoints and restores them on resume.

    Restoring happens when Lightning loads the callback states, before the training data loader draws its
    shuffling seed, so a resumed run sees the same batches and dropout masks as an uninterrupted one.
    """

    def state_dict(self) -> dict[str, Any]:
        mine = _local_rng_state()
        # dump_checkpoint runs on every rank (only rank 0 writes), so all ranks can take part in the gather
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("ranks") or []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= len(states):
            rank_zero_warn(
                f"The checkpoint holds random states for {len(states)} rank(s) but this run has more; ranks beyond "
                "them keep their seeded state, so the resumed run is not bit-identical to an uninterrupted one."
            )
            return
        _set_local_rng_state(states[rank])
