"""Throughput: images per second (global and per device) and the share of step time spent waiting for data.

Lightning's ``ThroughputMonitor`` counts samples and FLOPs but does not separate the time spent waiting for the next
batch from compute, which is the figure that shows a starving input pipeline (the original tutorial's BatchTime vs
DataTime); so this small callback measures both with host timers, over a sliding window, without device syncs.

The gap between two training steps holds two things (:func:`gap_parts`): the rank's wait for its next batch, from
the moment the training loop asks the loader for it (``ResumableLoader.asked_at``) until the batch is on the device
(the loader's fetch, the transfer, a GPU decode: whatever blocks), and Lightning's own loop between steps (hooks of
the step's end, logging, progress, the loop's bookkeeping), reported apart.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

from core.errors import InvalidValue
from core.layout import layout_of
from core.logging_steps import is_logging_step


def data_parallel_devices(trainer: Trainer) -> int:
    """Devices the global batch runs on: the GPUs of a process that splits its batch over them (``dp``, as its layout
    says), else the world size x the distinct devices of each process's stages (``ddp_mp`` splits each process's
    model over several GPUs; on CPU every stage is the CPU)."""
    if layout_of(type(trainer.strategy)).splits_batch:
        return max(1, trainer.num_devices)
    stages = getattr(trainer.strategy, "stage_devices", None)
    return trainer.world_size * (len(set(stages)) if stages is not None else 1)


def gap_parts(trainer: Trainer, start: float, last_end: float | None) -> tuple[float, float]:
    """The gap before the step starting at ``start`` (``time.perf_counter()``), since the previous one ended at
    ``last_end``: (waiting for the batch, Lightning's loop). A training loader without the request clock
    (``asked_at``: the app's :class:`~datamodules.resumable.ResumableLoader` has it) counts the whole gap as waiting."""
    if last_end is None:
        return 0.0, 0.0
    asked = getattr(trainer.train_dataloader, "asked_at", None)
    if asked is None or not last_end <= asked <= start:
        return start - last_end, 0.0
    return start - asked, asked - last_end


class Throughput(Callback):
    """Logs ``perf/images_per_sec`` (all ranks together), ``perf/images_per_sec_per_device`` and
    ``perf/data_time_frac`` (the share of the step spent waiting for the next batch: :func:`gap_parts`),
    ``perf/loop_time_frac`` (the share in Lightning's loop between steps) on logging steps
    (``core.logging_steps``: every step is timed, the window is summed only there), and ``perf/val_images_per_sec``
    once per validation.

    Validation and checkpointing between two steps are not counted. Figures are rank 0's view: the global rate is
    rank 0's rate times the world size (each rank gets an equal share of every global batch).

    Args:
        window: number of recent steps the logged figures are averaged over.
    """

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise InvalidValue(f"Throughput.window must be >= 1 step, got {window}. Fix: e.g. 50 (the default).")
        self.window = window
        self._steps: deque[tuple[int, float, float, float]] = deque(maxlen=window)
        self._last_end: float | None = None
        self._start = 0.0
        self._data_time = self._loop_time = 0.0
        self.total_images = 0  # global, over the whole fit
        self.total_time = 0.0
        self.total_data_time = self.total_loop_time = 0.0  # this rank's, over the whole fit
        self._val_images, self._val_start = 0, 0.0

    @property
    def mean_images_per_sec(self) -> float | None:
        """Global images per second averaged over the whole fit (None before the first step)."""
        return self.total_images / self.total_time if self.total_time > 0 else None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # the gap before an epoch's first batch holds epoch bookkeeping, not data waiting

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None

    @property
    def data_wait_frac(self) -> float | None:
        """The share of this rank's training time spent waiting for its next batch, over the whole fit."""
        return self.total_data_time / self.total_time if self.total_time > 0 else None

    @property
    def loop_frac(self) -> float | None:
        """The share of this rank's training time spent in Lightning's loop between steps, over the whole fit."""
        return self.total_loop_time / self.total_time if self.total_time > 0 else None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        self._data_time, self._loop_time = gap_parts(trainer, self._start, self._last_end)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        end = time.perf_counter()
        images = batch_size(batch) * trainer.world_size
        step_time = self._data_time + self._loop_time + (end - self._start)
        self._steps.append((images, self._data_time, self._loop_time, step_time))
        self.total_images += images
        self.total_time += step_time
        self.total_data_time += self._data_time
        self.total_loop_time += self._loop_time
        self._last_end = end
        if not is_logging_step(trainer):
            return  # host timers only: the window is summed and logged on logging steps
        n_images = sum(s[0] for s in self._steps)
        data_time, loop_time, total = (sum(s[k] for s in self._steps) for k in (1, 2, 3))
        if total <= 0:
            return
        rate = n_images / total
        metrics = {
            "perf/images_per_sec": rate,
            "perf/images_per_sec_per_device": rate / data_parallel_devices(trainer),
            "perf/data_time_frac": data_time / total,
            "perf/loop_time_frac": loop_time / total,
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_images, self._val_start = 0, time.perf_counter()

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int,
                                dataloader_idx: int = 0) -> None:  # fmt: skip
        self._val_images += batch_size(batch)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """``perf/val_images_per_sec``: validation images per second over all ranks, loading included (the
        epoch's metrics are computed after this hook, so the last batches' device work may be partly uncounted)."""
        seconds = time.perf_counter() - self._val_start
        if trainer.sanity_checking or self._val_images == 0 or seconds <= 0:
            return
        rate = self._val_images * trainer.world_size / seconds  # this rank's view; sync_dist: the ranks' mean
        pl_module.log("perf/val_images_per_sec", rate, on_epoch=True, sync_dist=True)


def batch_size(batch: Any) -> int:
    """Images in a batch: the first tensor's length for an ``(images, labels)`` pair, Lightning's search otherwise
    (``extract_batch_size`` walks the whole collection: ~0.1 ms per step)."""
    if isinstance(batch, list | tuple) and batch and isinstance(batch[0], Tensor):
        return len(batch[0])
    return extract_batch_size(batch)
