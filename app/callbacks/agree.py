"""One tiny all-reduce per training step answers every callback's "did this happen on any rank?" question.

The watched values and the step's answer belong to the run: an :class:`Agreement` kept on the Trainer, which every
callback of that Trainer reaches through these functions (the callbacks themselves hold no share of it, so they stay
deep-copyable, and a new Trainer starts with an empty one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch import Trainer
from torch.distributed import ReduceOp

_ATTRIBUTE = "_app_agreement"


class Agreement:
    """The values every step's all-reduce carries, and its last answer."""

    def __init__(self) -> None:
        # name -> the local value, read when the step's all-reduce happens. Registered in the same order on every rank
        # (the callbacks are built from the same config), so every rank lays the vector out alike.
        self.sources: dict[str, Callable[[], bool]] = {}
        self.agreed: tuple[int, dict[str, bool]] | None = None  # the last answer: batch, values

    def any_rank(self, trainer: Trainer, name: str, local: bool | None) -> bool:
        batch = trainer.fit_loop.total_batch_idx
        if self.agreed is not None and self.agreed[0] == batch and name in self.agreed[1]:
            return self.agreed[1][name]
        values = {n: bool(read()) for n, read in self.sources.items()}
        if local is not None:
            values[name] = bool(local)
        if trainer.world_size > 1 and values:
            flags = torch.tensor([float(v) for v in values.values()], device=trainer.strategy.root_device)
            flags = trainer.strategy.reduce(flags, reduce_op=ReduceOp.SUM)  # as Lightning's reduce_boolean_decision
            values = dict(zip(values, (v > 0 for v in flags.tolist()), strict=True))
        self.agreed = (batch, values)
        return values.get(name, False)


def agreement(trainer: Trainer) -> Agreement:
    """The Trainer's agreement, created at its first use."""
    found = vars(trainer).get(_ATTRIBUTE)
    if found is None:
        found = Agreement()
        setattr(trainer, _ATTRIBUTE, found)
    return found


def watch(trainer: Trainer, name: str, local: Callable[[], bool]) -> None:
    """Includes ``local()`` in every step's agreement under ``name`` (e.g. "a signal arrived on this rank")."""
    agreement(trainer).sources[name] = local


def unwatch(trainer: Trainer, name: str) -> None:
    shared = agreement(trainer)
    shared.sources.pop(name, None)
    shared.agreed = None


def any_rank(trainer: Trainer, name: str, local: bool | None = None) -> bool:
    """Whether ``name`` is true on any rank at this training batch.

    All ranks must act at the same step: one rank stopping or saving alone leaves the others waiting in a collective.
    The first callback to ask in a batch runs one all-reduce over every watched value and its own ``local`` value;
    the callbacks asking after it in the same batch read that answer. (A collective per callback and step costs about
    a millisecond each on gloo, measured in ``bench/step_time.py``.)
    """
    return agreement(trainer).any_rank(trainer, name, local)
