"""Stop at a target accuracy, with the decision agreed by all ranks, and record the time it took to get there."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.utilities import rank_zero_info

from app.callbacks.throughput import batch_size
from core.errors import InvalidValue


def as_fraction(target: float | None) -> float | None:
    """``0.75`` and ``75`` both mean 75 %: values in (0, 1] are fractions, values in (1, 100] are percents."""
    if target is None:
        return None
    if 0 < target <= 1:
        return float(target)
    if 1 < target <= 100:
        return target / 100.0
    raise InvalidValue(
        f"stop_at_accuracy.target must be a fraction in (0, 1] such as 0.75 or a percent in (1, 100] such as 75, "
        f"got {target}. Fix: e.g. --stop_at_accuracy.target 0.99."
    )


class StopAtAccuracy(EarlyStopping):
    """Stops training once ``monitor`` (default ``val/acc1``) is at least ``target``; no-op when ``target`` is None.

    Lightning's EarlyStopping does the rest: every rank evaluates the (already all-reduced) metric and the stop
    decision is reduced with ``reduce_boolean_decision``, so all ranks stop after the same validation. When the
    target is reached, time to accuracy is recorded in :attr:`result` (training wall time, epochs, samples seen,
    step), sent to every logger as ``time_to_target/*`` and shown in the final summary. It survives a resume.

    Args:
        target: the accuracy to reach, as a fraction (0.75) or a percent (75).
        monitor: the metric to watch (higher is better).
        verbose: log when the target is reached.
    """

    def __init__(self, target: float | None = None, monitor: str = "val/acc1", verbose: bool = True) -> None:
        self.target = as_fraction(target)
        # patience=sys.maxsize: only the target stops training, never a plateau
        super().__init__(monitor=monitor, mode="max", patience=sys.maxsize, strict=self.target is not None,
                         verbose=verbose)  # fmt: skip
        self.result: dict[str, float] | None = None
        self.elapsed_s = 0.0  # training wall time of previous runs of this fit (restored on resume)
        self.samples_seen = 0
        self._started: float | None = None

    def _should_skip_check(self, trainer: Trainer) -> bool:
        return self.target is None or super()._should_skip_check(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.samples_seen += batch_size(batch) * trainer.world_size

    def _wall_time(self) -> float:
        return self.elapsed_s + (time.perf_counter() - self._started if self._started is not None else 0.0)

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> tuple[bool, str | None]:
        # EarlyStopping's stopping_threshold compares with ">", the target is reached at ">="
        if current >= self.target:
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, f"{self.monitor} = {current.item():.4f} reached the target {self.target:.4f}."
        return super()._evaluate_stopping_criteria(current)

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        super()._run_early_stopping_check(trainer)
        current = trainer.callback_metrics.get(self.monitor)
        if self.result is not None or current is None or not trainer.should_stop or current < self.target:
            return
        batches = trainer.num_training_batches or 1
        epochs = trainer.current_epoch + min(1.0, (trainer.fit_loop.epoch_loop.batch_idx + 1) / batches)
        self.result = {
            "target": self.target,
            "reached": float(current),
            "wall_s": self._wall_time(),
            "epochs": float(epochs),
            "samples": float(self.samples_seen),
            "step": float(trainer.global_step),
        }
        for logger in trainer.loggers:
            logger.log_metrics({f"time_to_target/{k}": v for k, v in self.result.items()}, step=trainer.global_step)
        rank_zero_info(
            f"Time to accuracy: {self.monitor} >= {self.target:.4f} after {self.result['wall_s']:.1f} s, "
            f"{epochs:.2f} epoch(s), {self.samples_seen} samples (step {trainer.global_step})."
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "elapsed_s": self._wall_time(), "samples_seen": self.samples_seen,
                "result": self.result}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.elapsed_s = float(state_dict.get("elapsed_s", 0.0))
        self.samples_seen = int(state_dict.get("samples_seen", 0))
        self.result = state_dict.get("result")
