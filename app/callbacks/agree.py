"""One tiny all-reduce per training step answers every callback's "did this happen on any rank?" question."""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch import Trainer
from torch.distributed import ReduceOp

# name -> the local value, read when the step's all-reduce happens. Registered in the same order on every rank (the
# callbacks are built from the same config), so every rank lays the vector out alike.
_sources: dict[str, Callable[[], bool]] = {}
_agreed: tuple[Trainer, int, dict[str, bool]] | None = None  # the last answer: trainer, batch, values


def watch(name: str, local: Callable[[], bool]) -> None:
    """Includes ``local()`` in every step's agreement under ``name`` (e.g. "a signal arrived on this rank")."""
    _sources[name] = local


def unwatch(name: str) -> None:
    global _agreed
    _sources.pop(name, None)
    _agreed = None


def any_rank(trainer: Trainer, name: str, local: bool | None = None) -> bool:
    """Whether ``name`` is true on any rank at this training batch.

    All ranks must act at the same step: one rank stopping or saving alone leaves the others waiting in a collective.
    The first callback to ask in a batch runs one all-reduce over every watched value and its own ``local`` value;
    the callbacks asking after it in the same batch read that answer. (A collective per callback and step costs about
    a millisecond each on gloo, measured in ``bench/step_time.py``.)
    """
    global _agreed
    batch = trainer.fit_loop.total_batch_idx
    if _agreed is not None and _agreed[0] is trainer and _agreed[1] == batch and name in _agreed[2]:
        return _agreed[2][name]
    values = {n: bool(read()) for n, read in _sources.items()}
    if local is not None:
        values[name] = bool(local)
    if trainer.world_size > 1 and values:
        flags = torch.tensor([float(v) for v in values.values()], device=trainer.strategy.root_device)
        flags = trainer.strategy.reduce(flags, reduce_op=ReduceOp.SUM)  # as Lightning's reduce_boolean_decision
        values = dict(zip(values, (v > 0 for v in flags.tolist()), strict=True))
    _agreed = (trainer, batch, values)
    return values.get(name, False)
