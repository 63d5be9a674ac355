"""What every image DataModule shares: one batch-size semantics and exact (unpadded) evaluation.

Batch semantics, stated once: ``batch_size`` is the number of images each process loads per step (per device under
``ddp``/``allreduce``; under ``dp`` the one process's batch is split across its GPUs). The global batch, the images
behind one optimizer step, is ``batch_size x world_size x accumulate_grad_batches``. Alternatively give
``global_batch_size``: ``setup()`` derives the per-device batch from it and refuses a global batch that does not split
evenly, naming every factor.

Exact evaluation: Lightning's injected ``DistributedSampler`` pads the validation set with duplicates so that every
rank gets the same number of images, which biases accuracy (pytorch/pytorch#25162). For validation, test and predict
loaders the DataModule uses Lightning's ``UnrepeatedDistributedSampler`` itself (Lightning then leaves it alone), so
every image is evaluated exactly once and the metric sums are exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a run: what one process loads, how many processes, how many steps are accumulated."""

    per_device: int
    world_size: int
    accumulate_grad_batches: int = 1

    @property
    def global_batch(self) -> int:
        """Images behind one optimizer step, summed over all processes."""
        return self.per_device * self.world_size * self.accumulate_grad_batches

    def describe(self) -> str:
        return (
            f"batch {self.per_device} per device x {self.world_size} processes x "
            f"{self.accumulate_grad_batches} accumulated = global batch {self.global_batch}"
        )


def nearest_multiples(global_batch_size: int, factor: int) -> tuple[int, int]:
    """The valid global batches around one that ``factor`` (processes x accumulation) does not divide."""
    return max(factor, global_batch_size // factor * factor), (global_batch_size // factor + 1) * factor


def resolve_batch(
    batch_size: int,
    global_batch_size: int | None,
    world_size: int,
    accumulate_grad_batches: int = 1,
    num_nodes: int | None = None,
) -> BatchPlan:
    """Derives the per-device batch: ``batch_size`` as given, or ``global_batch_size`` split over every factor.

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of world size x accumulation; the message names the
            factors and the nearest valid values.
    """
    if global_batch_size is None:
        return BatchPlan(batch_size, world_size, accumulate_grad_batches)
    factor = world_size * accumulate_grad_batches
    if global_batch_size <= 0 or global_batch_size % factor:
        if num_nodes and num_nodes > 1:
            processes = f"{world_size} processes ({world_size // num_nodes} per node x {num_nodes} nodes)"
        else:
            processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        lower, upper = nearest_multiples(global_batch_size, factor)
        raise ValueError(
            f"data.global_batch_size={global_batch_size} cannot be split evenly: it must be a positive multiple of "
            f"{processes} x trainer.accumulate_grad_batches {accumulate_grad_batches} = {factor}. "
            f"Use e.g. {lower} or {upper}, or give the per-device data.batch_size instead."
        )
    return BatchPlan(global_batch_size // factor, world_size, accumulate_grad_batches)


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which SLURM and containers narrow), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def workers_warning(num_workers: int, processes_per_node: int, cpus: int | None = None) -> str | None:
    """A warning when the DataLoader workers of all processes on this node outnumber its CPUs, else None."""
    cpus = cpus or available_cpus()
    total = num_workers * processes_per_node
    if total <= cpus:
        return None
    fit = max(cpus // max(processes_per_node, 1) - 1, 0)
    return (
        f"data.num_workers {num_workers} x {processes_per_node} process(es) on this node = {total} loader workers "
        f"for {cpus} CPUs: the workers compete for CPUs and the input pipeline slows down. "
        f"Use --data.num_workers {fit} or fewer (one CPU per process stays for the training loop)."
    )


class ImageDataModule(LightningDataModule):
    """Base of the app's DataModules: per-device batch semantics, ``global_batch_size``, exact evaluation.

    Subclasses build their datasets in ``setup()`` (calling ``super().setup(stage)`` first) and their loaders with
    :meth:`_loader`.

    Args:
        batch_size: images per device and step (under ``dp``: per process, split across its GPUs).
        global_batch_size: if given, images per optimizer step over all processes; the per-device batch is derived
            from it in ``setup()`` and ``batch_size`` is ignored.
        num_workers: DataLoader worker processes per training process.
    """

    def __init__(self, batch_size: int, global_batch_size: int | None = None, num_workers: int = 0) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"data.batch_size must be a positive number of images per device, got {batch_size}")
        if global_batch_size is not None and global_batch_size <= 0:
            raise ValueError(f"data.global_batch_size must be a positive number of images, got {global_batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be 0 (load in the main process) or more, got {num_workers}")
        self.batch_size = batch_size
        self._batch_size_arg = batch_size
        self.requested_global_batch_size = global_batch_size
        self.num_workers = num_workers
        self.batch_plan: BatchPlan | None = None

    @property
    def global_batch_size(self) -> int | None:
        """Images per optimizer step over all processes, known once ``setup()`` has run under a Trainer."""
        return self.batch_plan.global_batch if self.batch_plan else None

    def setup(self, stage: str | None = None) -> None:
        trainer = self.trainer
        if trainer is None:
            return
        self.batch_plan = resolve_batch(
            self._batch_size_arg,
            self.requested_global_batch_size,
            trainer.world_size,
            trainer.accumulate_grad_batches,
            trainer.num_nodes,
        )
        self.batch_size = self.batch_plan.per_device
        if self.requested_global_batch_size is not None:
            rank_zero_info(f"data.global_batch_size {self.requested_global_batch_size}: {self.batch_plan.describe()}")
        warning = workers_warning(self.num_workers, max(trainer.world_size // max(trainer.num_nodes, 1), 1))
        if warning:
            rank_zero_warn(warning)

    def _eval_sampler(self, dataset: Dataset) -> UnrepeatedDistributedSampler | None:
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not kwargs or kwargs.get("num_replicas", 1) <= 1:
            return None
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        return UnrepeatedDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)

    def _loader(self, dataset: Dataset, train: bool, **kwargs: Any) -> DataLoader:
        """A loader with the per-device batch; evaluation loaders get the unpadded sampler when distributed.

        Training loaders keep a plain shuffling sampler: Lightning swaps it for a ``DistributedSampler`` and calls
        ``set_epoch`` under every distributed strategy.
        """
        sampler = None if train else self._eval_sampler(dataset)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )
