"""A small table at the end of ``fit`` on rank 0, also written to ``<log_dir>/summary.json``; in a multi-process run
its last block is the per-rank step time of :class:`~app.callbacks.stragglers.Stragglers`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from app.callbacks.amp import AMPHealth
from app.callbacks.stop_at_accuracy import StopAtAccuracy
from app.callbacks.stragglers import Stragglers, render
from app.callbacks.throughput import Throughput, data_parallel_devices
from core.env import detect

RESTARTED_BY = {"torchrun": "torch's elastic agent", "slurm": "a SLURM requeue"}


def _find(trainer: Trainer, kind: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


class TrainingSummary(Callback):
    """At the end of ``fit``, rank 0 prints best and last validation accuracy, time to target (with
    :class:`StopAtAccuracy`), mean throughput and the shares of the step spent waiting for data and in Lightning's
    loop (with :class:`Throughput`), skipped AMP steps (with :class:`AMPHealth`),
    world size, strategy and precision, then (with :class:`Stragglers`, more than one process) the per-rank step
    time table naming the slowest rank, and writes the same figures to ``summary.json`` in the run folder.

    Args:
        monitor: the accuracy metric to report.
    """

    shows_stragglers = True  # Stragglers leaves its table to this summary

    def __init__(self, monitor: str = "val/acc1") -> None:
        self.monitor = monitor
        self.best: float | None = None
        self.last: float | None = None
        self.summary: dict[str, Any] = {}
        self.ranks: list[dict[str, Any]] = []
        # the restarts this run healed, kept in its checkpoints across attempts: {restart, launcher, resumed at step,
        # lost_s} with lost_s from the save of the checkpoint it resumed to its first step after the restart
        self.faults: list[dict[str, Any]] = []
        self._saved_at: float | None = None  # time.time() of the save of the checkpoint this run resumed from
        self._resumed: dict[str, Any] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        launch = detect()
        if launch.restart_count and self._saved_at is not None:  # a restarted attempt that resumed a checkpoint
            launcher = RESTARTED_BY.get(launch.launcher, launch.launcher)
            step = trainer.global_step
            self._resumed = {"restart": launch.restart_count, "launcher": launcher, "resumed at step": step}

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self._resumed is not None and self._saved_at is not None:
            known = {(f["launcher"], f["restart"]) for f in self.faults}
            if (self._resumed["launcher"], self._resumed["restart"]) not in known:
                self.faults.append({**self._resumed, "lost_s": round(time.time() - self._saved_at, 1)})
            self._resumed = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        self.last = float(trainer.callback_metrics[self.monitor])
        self.best = self.last if self.best is None else max(self.best, self.last)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stop, throughput, amp = _find(trainer, StopAtAccuracy), _find(trainer, Throughput), _find(trainer, AMPHealth)
        self.summary = {
            f"best {self.monitor}": self.best,
            f"last {self.monitor}": self.last,
            "epochs": trainer.current_epoch,
            "steps": trainer.global_step,
            "target": stop.target if stop else None,
            "time to target": stop.result if stop else None,
            "mean images/s (global)": throughput.mean_images_per_sec if throughput else None,
            # rank 0's shares of its training time (every rank's: the per-rank table below)
            "waiting for data": _share(throughput.data_wait_frac) if throughput else None,
            "Lightning's loop between steps": _share(throughput.loop_frac) if throughput else None,
            "devices": data_parallel_devices(trainer),
            "world size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "precision": trainer.precision,
            "AMP skipped steps": amp.skipped_steps if amp else None,
        }
        if self.faults:  # what the restarts (a fault healed, a preemption's requeue) cost
            lost = sum(f["lost_s"] for f in self.faults)
            self.summary["restarts"] = f"{len(self.faults)} ({self.faults[-1]['launcher']}), {lost:.1f} s lost"
        stragglers = _find(trainer, Stragglers)
        self.ranks = stragglers.collect(trainer) if stragglers else []  # a collective: every rank gathers
        # Lightning's Rich progress bar draws its last frame when it stops, in its teardown (after on_fit_end): stopped
        # here, the bar of the last epoch is finished before the table, not drawn below it (TQDM's teardown: no-op)
        if trainer.progress_bar_callback is not None:
            trainer.progress_bar_callback.teardown(trainer, pl_module, "fit")
        # Trainer.log_dir broadcasts from rank 0: every rank must ask for it, not only the one that writes
        self._report(Path(trainer.log_dir or trainer.default_root_dir))

    @rank_zero_only
    def _report(self, folder: Path) -> None:
        rows = [(key, _fmt(value)) for key, value in self.summary.items()]
        width = max(len(k) for k, _ in rows)
        rule = "-" * (width + 3 + max(len(v) for _, v in rows))
        block = ["Training summary", rule, *(f"{k:<{width}}   {v}" for k, v in rows), rule]
        if self.ranks:
            block += [render(self.ranks), rule]
        rank_zero_info("\n".join(block))
        folder.mkdir(parents=True, exist_ok=True)
        figures = {**self.summary, **({"per rank": self.ranks} if self.ranks else {})}
        if self.faults:
            figures["faults"] = self.faults
        (folder / "summary.json").write_text(json.dumps(figures, indent=2) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "last": self.last, "faults": self.faults, "saved_at": time.time()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.last = state_dict.get("best"), state_dict.get("last")
        self.faults, self._saved_at = list(state_dict.get("faults") or []), state_dict.get("saved_at")


def _share(fraction: float | None) -> str | None:
    return None if fraction is None else f"{fraction:.1%} of the step"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # time to target
        return f"{value['wall_s']:.1f} s, {value['epochs']:.2f} epochs, {int(value['samples'])} samples"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:,.0f}"
    return str(value)
