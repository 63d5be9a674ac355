"""The batch arithmetic, in one place: the per-device batch, the global batch (the images behind one optimizer step),
a global batch that does not split, and the learning rate scaled by the global batch.

``batch_size`` is the number of images each process loads per step (per device under ``ddp``/``allreduce``; under
``dp`` the one process's batch is split across its GPUs). The global batch is ``batch_size x world_size x
accumulate_grad_batches``, computed only by :attr:`BatchPlan.global_batch`. The DataModules, the model's lr scaling
and the preflight plan all ask this module.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def uneven_global_batch(
    global_batch_size: int, world_size: int, accumulate_grad_batches: int = 1, num_nodes: int | None = None
) -> str | None:
    """The one message for a ``global_batch_size`` that does not split over every factor (None when it does): the
    DataModule raises it, the preflight reports it before anything starts."""
    factor = world_size * accumulate_grad_batches
    if global_batch_size > 0 and global_batch_size % factor == 0:
        return None
    if num_nodes and num_nodes > 1:
        processes = f"{world_size // num_nodes} processes per node x {num_nodes} nodes"
    else:
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    lower, upper = nearest_multiples(global_batch_size, factor)
    return (
        f"data.global_batch_size={global_batch_size} does not split evenly over world size {world_size} "
        f"({processes}) x trainer.accumulate_grad_batches {accumulate_grad_batches} = {factor}. Fix: a multiple of "
        f"{factor} (e.g. {lower} or {upper}), the per-device data.batch_size instead, or another device count."
    )


def resolve_batch(
    batch_size: int,
    global_batch_size: int | None,
    world_size: int,
    accumulate_grad_batches: int = 1,
    num_nodes: int | None = None,
) -> BatchPlan:
    """The batch arithmetic, in one place: ``batch_size`` per device as given, or ``global_batch_size`` split over
    every factor (processes x accumulation).

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of world size x accumulation (:func:`uneven_global_batch`).
    """
    if global_batch_size is None:
        return BatchPlan(batch_size, world_size, accumulate_grad_batches)
    if problem := uneven_global_batch(global_batch_size, world_size, accumulate_grad_batches, num_nodes):
        raise ValueError(problem)
    factor = world_size * accumulate_grad_batches
    return BatchPlan(global_batch_size // factor, world_size, accumulate_grad_batches)


def linear_scaled_lr(lr: float, global_batch: int, reference_batch: int | None) -> float:
    """The linear scaling rule (Goyal et al. 2017): ``lr`` is per ``reference_batch`` images; None: unscaled."""
    return lr * global_batch / reference_batch if reference_batch else lr


def torchvision_adjusted(decay: float, global_batch: int, every: int, epochs: int) -> float:
    """torchvision's reference: the EMA decay per update for a run of this global batch and length."""
    return 1.0 - min(1.0, (1.0 - decay) * global_batch * every / max(epochs, 1))
