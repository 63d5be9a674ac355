"""Data sets held whole in memory, on the training device: a batch is one indexing of a tensor.

For a set that fits (MNIST: 55k images of 28x28, 172 MB as float32) the DataLoader's per-sample path is most of the
step: fetch each sample by index, then stack them in Python. :class:`ResidentTensors` answers the loader's batched
fetch (``__getitems__``, which torch's DataLoader calls with the batch sampler's whole index list) with one
``index_select`` per tensor, on the device that holds them, and :func:`whole_batch` passes the result through as
the batch. The loader, its sampler, and therefore the sample order, DDP sharding, exact evaluation and mid-epoch
resume stay exactly those of the loader path (``datamodules.base``); only the fetch changes. No worker processes:
there is nothing left for them to do.

Written by hand because torch's ``TensorDataset`` has no batched fetch (each sample is indexed and stacked), and
neither torchdata nor litdata keeps a split as device tensors.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import Dataset

from core.errors import UserError

Resident = bool | Literal["auto"]  # --data.resident auto|true|false

# `auto` keeps a split resident when all of them together take at most this share of the device's free memory
FREE_MEMORY_SHARE = 0.25


class ResidentError(UserError, ValueError):
    """``--data.resident`` given with settings it cannot honour."""


class ResidentTensors(Dataset):
    """Equal-length tensors (images, labels) whose batches are single ``index_select`` calls."""

    def __init__(self, *tensors: torch.Tensor, indices: list[int] | None = None) -> None:
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError("ResidentTensors needs tensors of one length")
        self.tensors = tensors
        self.indices = indices  # which rows of the source set these are (a split's), as torch's Subset has them

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        device = self.tensors[0].device
        if device.type != "cuda":
            index = torch.as_tensor(indices, device=device)
        else:  # a copy from pageable host memory would block the host until the device's queue drains
            index = torch.tensor(indices, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
        return [t.index_select(0, index) for t in self.tensors]

    def to(self, device: torch.device) -> ResidentTensors:
        return ResidentTensors(*(t.to(device) for t in self.tensors), indices=self.indices)


def quiet_the_worker_hint() -> None:
    """Lightning's "does not have many workers" hint, silenced once the data is resident.

    Lightning gives it for every loader with fewer than 2 workers on a machine with more than 2 CPUs; a resident
    split has no per-sample work a worker could take, so the hint would ask for workers that are refused
    (``--data.resident true`` with workers) or would turn the resident path off (``auto``). Lightning has no per-loader
    switch for it: its docs filter the message (advanced/warnings), which stays shown for the per-sample path of any
    other run of this process until one goes resident.
    """
    warnings.filterwarnings(
        "ignore", message=r"The '\w+_dataloader' does not have many workers", category=PossibleUserWarning
    )


def whole_batch(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The loader's ``collate_fn`` for :class:`ResidentTensors`: the fetch already is the batch."""
    return batch


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or the host's ``MemAvailable``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def workers_conflict(num_workers: int) -> str:
    """Why ``--data.resident true`` and loader workers do not go together, and the fix."""
    return (
        f"data.resident true builds each batch in the training process from the data set held on the device, so "
        f"data.num_workers {num_workers} would have nothing to load. Fix: drop --data.num_workers (or give 0), or "
        "--data.resident false to load through worker processes."
    )


def decide(resident: Resident, num_workers: int, nbytes: int, device: torch.device) -> tuple[bool, str]:
    """Whether the splits stay resident, and the one line that says why.

    ``true`` with loader workers is refused (they would have nothing to load); ``auto`` is resident when no workers
    were asked for and the splits take at most :data:`FREE_MEMORY_SHARE` of the device's free memory.
    """
    mb = nbytes / 2**20
    if resident is True:
        if num_workers:
            raise ResidentError(workers_conflict(num_workers))
        return True, f"data.resident: the splits ({mb:.0f} MB) stay on {device}; a batch is one indexing"
    if resident is False:
        return False, "data.resident false: batches come through the DataLoader's per-sample path"
    if num_workers:
        return False, f"data.resident auto: data.num_workers {num_workers} asked for, so the loader path is used"
    free = free_memory(device)
    if nbytes <= FREE_MEMORY_SHARE * free:
        return True, (
            f"data.resident auto: the splits ({mb:.0f} MB) take {nbytes / free:.0%} of {device}'s free memory "
            f"(at most {FREE_MEMORY_SHARE:.0%}), so they stay there; a batch is one indexing"
        )
    return False, (
        f"data.resident auto: the splits ({mb:.0f} MB) would take {nbytes / free:.0%} of {device}'s free memory "
        f"(over {FREE_MEMORY_SHARE:.0%}): the loader path is used"
    )
