"""The ranks agree on host-side events ("a signal arrived on some rank") without a blocking collective per step.

When a training batch starts, each rank starts one tiny asynchronous all-reduce of its watched flags, on CPU tensors
over a gloo group (the default group when it is gloo, else one gloo group made for this); when the batch ends, it
waits for that reduction (it ran while the step computed) and acts on it. So every rank acts at the end of the same
step, on the flags of that step's start, and no step waits on the network or drains the device queue for it
(``bench/step_time.py``, ``app_ddp_callbacks``). With one process the flags are read directly, at the batch's end.

The watched values and the pending reduction belong to the run: an :class:`Agreement` kept on the Trainer, which
every callback of that Trainer reaches through these functions (the callbacks themselves hold no share of it, so
they stay deep-copyable, and a new Trainer starts with an empty one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

_ATTRIBUTE = "_app_agreement"


class Agreement:
    """The flags every step's all-reduce carries, the reduction in flight and the last answer."""

    def __init__(self) -> None:
        # name -> the local value. Registered in the same order on every rank (the callbacks are built from the same
        # config), so every rank lays the vector out alike.
        self.sources: dict[str, Callable[[], bool]] = {}
        self.agreed: tuple[int, dict[str, bool]] | None = None  # the answer acted on at a batch: (batch, values)
        self.pending: tuple[int, list[str], torch.Tensor, Any] | None = None  # (batch, names, tensor, work)
        self.group: Any = None

    def start(self, trainer: Trainer) -> None:
        """At a training batch's start: every rank's flags go into an asynchronous all-reduce (once per batch)."""
        if not self._distributed(trainer) or not self.sources:
            return
        batch = trainer.fit_loop.total_batch_idx
        if self.pending is not None:
            if self.pending[0] == batch:
                return
            self.wait()  # an earlier batch's, never asked for: collected first, so the order stays the same
        names = list(self.sources)
        flags = torch.tensor([float(bool(self.sources[n]())) for n in names])  # CPU: no device queue involved
        self.pending = (batch, names, flags, dist.all_reduce(flags, group=self._group(), async_op=True))

    def any_rank(self, trainer: Trainer, name: str) -> bool:
        batch = trainer.fit_loop.total_batch_idx
        if self.agreed is None or self.agreed[0] != batch:
            if not self._distributed(trainer):
                values = {n: bool(read()) for n, read in self.sources.items()}
            elif self.pending is not None and self.pending[0] == batch:
                values = self.wait()
            else:
                values = {}  # nothing was started at this batch's start (the watch began during the batch)
            self.agreed = (batch, values)
        return self.agreed[1].get(name, False)

    @staticmethod
    def _distributed(trainer: Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def wait(self) -> dict[str, bool]:
        """Waits for the reduction in flight, if any, and returns its values (also before the run ends, so that no
        collective is left running when the process group is destroyed)."""
        if self.pending is None:
            return {}
        _, names, flags, work = self.pending
        self.pending = None
        work.wait()
        return {n: v > 0 for n, v in zip(names, flags.tolist(), strict=True)}

    def _group(self) -> Any:
        """None (the default group) when it is gloo, else a gloo group made once for this (every rank gets here at
        the start of the same, first, batch, so new_group's collective lines up). No reference to the default group
        is kept: destroy_process_group() at the process's end must drop the last one, so that the group's destructor
        joins gloo's worker threads while Python is still alive (``app.launch.group``)."""
        if dist.get_backend() == "gloo":
            return None
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        return self.group


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


def unwatch(trainer: Trainer, name: str, finished: bool = True) -> None:
    """Stops watching ``name``. When nothing is left to watch, the reduction in flight is waited for (every rank
    started it), so none is left running when the process group is destroyed; after an error (``finished`` False) a
    peer may be gone, so it is dropped instead, for every watcher of the run."""
    shared = agreement(trainer)
    shared.sources.pop(name, None)
    shared.agreed = None
    if not finished:
        shared.pending = None
    elif not shared.sources:
        shared.wait()
    if not shared.sources:
        shared.group = None  # (the same reason as in Agreement._group: the run's end must not keep a group alive)


def start(trainer: Trainer) -> None:
    """Starts this training batch's agreement (call from ``on_train_batch_start``; the first call of a batch does)."""
    agreement(trainer).start(trainer)


def any_rank(trainer: Trainer, name: str) -> bool:
    """Whether the watched ``name`` was true on any rank, as agreed at this training batch: the flags every rank read
    when the batch started (so all ranks see the same answer at the same step), or at once with one process. The
    first callback to ask in a batch collects the agreement; the others asking in the same batch read its answer.
    """
    return agreement(trainer).any_rank(trainer, name)
