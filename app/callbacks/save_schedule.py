"""When the run saves (:class:`SaveSchedule`): Lightning's ``ModelCheckpoint``, configured by the ``--checkpoint.*``
CLI group. How a save is written (atomically, in the background, copied to the node) is the checkpoint package's
(:mod:`app.checkpoint`)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch import callbacks
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from app.checkpoint import AtomicCheckpointIO, BackgroundSaves, atomic_io, remove_local_copies, restarts_in_place
from app.lightning_private import should_accumulate
from app.resilience import agree
from core.env import detect

INTERVAL = "interval_save"  # the agreement's flag: rank 0's interval has elapsed


class SaveSchedule(callbacks.ModelCheckpoint):
    """When the run saves: Lightning's ``ModelCheckpoint`` (its state keeps that name); a checkpoint saved under a
    relative run folder reloads without a warning.

    Lightning resolves ``dirpath`` at setup from the logger (``runs/mnist/version_0/checkpoints`` for the default
    relative run folder) and saves it in the checkpoint, but ``realpath``s a ``dirpath`` given to ``__init__``; when a
    checkpoint is loaded (``--test_after_fit best``, ``--ckpt_path``) the two spellings of one folder read as "The
    dirpath has changed" and the best-model state is dropped. Here the folder is made absolute at setup, and a saved
    one (also a relative one of an older checkpoint) is resolved the same way before Lightning compares them.

    ``last.ckpt`` is the state training ended in. Lightning writes it at the end of ``fit`` only when the run wrote
    none yet: with ``--checkpoint.every_n_train_steps N`` (which switches off the end-of-epoch saves) the last one
    can be up to N - 1 steps old, and a run that ``--trainer.max_steps`` ends mid-epoch keeps the last one before
    it, so raising ``max_steps`` with ``--ckpt_path last`` would train those steps again. Here it is written at the
    end of ``fit`` unless this step is saved already; for ``max_steps`` mid-epoch, at that step's end instead
    (by the end of ``fit`` Lightning counts the unfinished epoch as completed): the same state as an
    ``every_n_train_steps`` save. At an epoch's last batch the validation's own save comes first, as usual.

    ``interval_minutes`` (default 10): ``last.ckpt`` is also saved once that much wall-clock time has passed since
    the last save of this run, so a fault (a dead or hung rank, a requeue) loses at most that much training, not an
    epoch. Lightning's own ``train_time_interval`` switches the end-of-epoch saves of the best checkpoint off and
    broadcasts rank 0's clock before every step; here rank 0's "time is up" rides the asynchronous per-step agreement
    of :mod:`app.resilience.agree` (no collective of its own), so every rank saves at the end of the same optimizer
    step. Each save keeps the file it replaces as ``last.previous.ckpt`` (:class:`app.checkpoint.AtomicCheckpointIO`).

    ``background`` (default on): the saves during training are written by a thread
    (:class:`app.checkpoint.BackgroundSaves`); training stops only to copy the state to host memory. The save at the
    end of ``fit`` is waited for. ``local_copy``: each ``last.ckpt`` is also copied to the node's own storage, which
    a restart on the same node reads first (:mod:`app.checkpoint.local_copy`); by default only when the launcher
    restarts the processes in place (``--launch.max_restarts`` under Lightning's launcher, ``torchrun
    --max-restarts``), and removed when the fit ends.
    """

    def __init__(
        self,
        *args: Any,
        interval_minutes: float | None = 10.0,
        background: bool = True,
        local_copy: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            interval_minutes: save ``last.ckpt`` whenever this many minutes of training have passed since the last
                save (None or 0: only the saves the other arguments ask for).
            background: write the saves made during training from a thread while training goes on (the state is
                copied to host memory first: that copy is the only pause, and the host holds it until written).
            local_copy: also copy each ``last.ckpt`` to ``$SLURM_TMPDIR``, ``$TMPDIR`` or ``/dev/shm``, read first by
                a restart on the same node. None (default): when the launcher restarts the processes in place.
            *args, **kwargs: Lightning's ``ModelCheckpoint``.
        """
        super().__init__(*args, **kwargs)
        self.interval_minutes = interval_minutes
        self.background = background
        self.local_copy = local_copy
        self._ending = False  # the save at the end of fit: waited for
        self._last_save: float | None = None  # time.monotonic() of the last save (or of the training start)
        self._pending: int | None = None  # a step save due at an epoch's last batch, made at the epoch's end
        self._watching = False

    def _interval_due(self) -> bool:
        return self._last_save is not None and time.monotonic() - self._last_save >= 60 * self.interval_minutes

    def _interval_agreed(self, trainer) -> bool:
        """Whether every rank saves at this batch's end: rank 0's interval had elapsed at its start, this is an
        optimizer step's end (never inside an accumulation: the flag stays up until one), not saved already."""
        if not self._watching or not agree.any_rank(trainer, INTERVAL):
            return False
        return not should_accumulate(trainer) and not self._should_skip_saving_checkpoint(trainer)

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.dirpath and _is_local_file_protocol(self.dirpath):  # one spelling of the folder: the docstring's
            self.dirpath = os.path.realpath(os.path.expanduser(self.dirpath))
        self._ending = False
        io = trainer.strategy.checkpoint_io
        atomic = atomic_io(io)
        if stage != "fit" or not isinstance(atomic, AtomicCheckpointIO):
            return
        atomic.local_copy = restarts_in_place(detect()) if self.local_copy is None else self.local_copy
        if self.background and not isinstance(io, BackgroundSaves):
            trainer.strategy.checkpoint_io = BackgroundSaves(atomic)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        local = getattr(atomic_io(trainer.strategy.checkpoint_io), "local_copy", False)
        finished = self._ending and not trainer.interrupted  # training ended (not an exception): nothing restarts
        if stage == "fit" and finished and local and trainer.is_global_zero:
            remove_local_copies(Path(self.dirpath))

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_save = time.monotonic()
        if self.interval_minutes and self.save_last:  # the same on every rank: the agreement's order stays the same
            due = self._interval_due if trainer.global_rank == 0 else (lambda: False)
            agree.watch(trainer, INTERVAL, due)
            self._watching = True

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._watching:
            agree.start(trainer)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self._ending = True
        self._stop_watching(trainer, finished=True)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):  # this step not saved yet
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)
        if isinstance(trainer.strategy.checkpoint_io, BackgroundSaves) and hasattr(trainer, "wait_for_saves"):
            trainer.wait_for_saves()  # the best checkpoint, saved in the background, is on disk for every rank's test

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop_watching(trainer, finished=False)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, BackgroundSaves):  # the save in flight completes before this process goes on or ends
            with contextlib.suppress(Exception):
                io.wait()
        super().on_exception(trainer, pl_module, exception)

    def _stop_watching(self, trainer, finished: bool) -> None:
        if self._watching:
            self._watching = False
            agree.unwatch(trainer, INTERVAL, finished)

    @override
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        io = trainer.strategy.checkpoint_io
        defer = isinstance(io, BackgroundSaves) and trainer.state.fn == TrainerFn.FITTING and not self._ending
        with _deferring(io) if defer else contextlib.nullcontext():
            super()._save_checkpoint(trainer, filepath)
        self._last_save = time.monotonic()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        checked = self._last_time_checked
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        # Lightning (2.6) defers a step save whose monitored metric (val/acc1) does not exist yet to a validation,
        # the top-k and last.ckpt alike, and at an epoch's last batch it loses it: before the first validation
        # nothing is saved, and a fault there loses up to an epoch. last.ckpt holds the state, not a score: it is
        # saved now (the top-k waits); at an epoch's last batch, after the epoch's own saves (on_train_epoch_end),
        # which a save at this step would otherwise skip. The wall-clock interval's save goes the same way.
        deferred = self._due(trainer, checked) and getattr(self, "_defer_save_until_validation", False)
        if deferred or self._interval_agreed(trainer):
            if last_batch:
                self._pending = trainer.global_step
            else:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        ended = 0 < trainer.max_steps <= trainer.global_step
        if self.save_last and ended and not last_batch and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._pending == trainer.global_step and not self._should_skip_saving_checkpoint(trainer):  # not saved yet
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._pending = None

    def _due(self, trainer, checked: float | None) -> bool:
        """Whether this batch's end is a step save (``every_n_train_steps``, or ``train_time_interval`` elapsed: the
        parent's clock moved) that has not been saved."""
        by_steps = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        by_time = self._last_time_checked != checked
        return self.save_last and (by_steps or by_time) and not self._should_skip_saving_checkpoint(trainer)

    @property
    @override
    def state_key(self) -> str:
        # the name checkpoints hold this state under, also those saved while the class was called ModelCheckpoint:
        # Lightning restores the best-model state by it, and an evaluation finds the folder by it
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__) :]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath"):
            state_dict = {**state_dict, "dirpath": os.path.realpath(os.path.expanduser(state_dict["dirpath"]))}
        super().load_state_dict(state_dict)


@contextlib.contextmanager
def _deferring(io: BackgroundSaves):
    io.deferring = True
    try:
        yield
    finally:
        io.deferring = False
