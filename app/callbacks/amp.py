"""AMP health: loss-scale telemetry, Apex-style overflow messages, scheduler hygiene, and a guard against NaNs.

Works with every precision: the loss-scale parts are active only when the precision plugin owns an enabled
``GradScaler`` (``16-mixed``); the non-finite-loss guard is active for every precision.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from core.errors import InvalidValue, UserError
from core.logging_steps import is_logging_step


class NonFiniteLossError(UserError, RuntimeError):
    """Raised on every rank when the loss stayed NaN/inf for too many consecutive steps (a user-facing outcome: the
    CLI prints it as one ``error:`` line on every rank and exits 1)."""

    help = "non-finite-loss"


def grad_scaler(trainer: Trainer) -> torch.amp.GradScaler | None:
    """The enabled GradScaler of the run's precision plugin, or None (fp32, bf16, true half precision)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


class AMPHealth(Callback):
    """Watches mixed-precision training and stops training on NaNs instead of silently continuing.

    - Logs ``amp/loss_scale`` and ``amp/skipped_steps`` on logging steps when a GradScaler is in use.
    - On an overflow prints, on rank 0 and at most once per ``message_interval_steps`` optimizer steps,
      ``Gradient overflow at step N. Skipping step, loss scaler reducing loss scale to X`` (as Apex did).
    - A step the GradScaler skipped does not advance per-step LR schedulers (Lightning#5558).
    - ``max_nonfinite_steps`` consecutive non-finite losses (on any rank) stop the run on every rank with a
      :class:`NonFiniteLossError` naming the steps, the loss and the parameters whose gradients were not finite.
      The losses are counted on the device every step and read on logging steps (``trainer.log_every_n_steps``),
      at each epoch's end and before any checkpoint is saved (a run that reached the limit stops before the save),
      and the steps in between carry no host read. "Before any save" covers the weights-only checkpoints too, for
      which Lightning calls no callback's ``on_save_checkpoint``: the check also runs where ModelCheckpoint saves
      (the end of validation, and training batches at which it may save), before it, since Lightning runs the
      checkpoint callbacks last.

    Args:
        max_nonfinite_steps: consecutive non-finite losses tolerated before stopping; ``None`` disables the guard
            (each check is one tiny all-reduce under distributed strategies, so that all ranks stop together).
        message_interval_steps: minimum number of optimizer steps between two overflow messages.
    """

    def __init__(self, max_nonfinite_steps: int | None = 3, message_interval_steps: int = 100) -> None:
        if max_nonfinite_steps is not None and max_nonfinite_steps < 1:
            raise InvalidValue(
                f"AMPHealth.max_nonfinite_steps must be >= 1 or null (off), got {max_nonfinite_steps}. Fix: e.g. 3 "
                "(the default)."
            )
        self.max_nonfinite_steps = max_nonfinite_steps
        self.message_interval_steps = message_interval_steps
        self.skipped_steps = 0
        self.overflow_messages: list[str] = []  # what was printed, kept for the summary and for tests
        self._scale_before: float | None = None
        self._snapshots: list[tuple[Any, dict, list[dict]]] = []
        self._last_message_step: int | None = None
        self._unreported = 0
        self._run = torch.zeros((), dtype=torch.int32)  # consecutive non-finite losses up to the last step
        self._longest = torch.zeros((), dtype=torch.int32)  # the longest such run
        self._last_loss: torch.Tensor | None = None
        self._saved_after_nonfinite: int | None = None  # a step a save was allowed at just after a non-finite loss

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        scaler = grad_scaler(trainer)
        if scaler is None:
            return
        self._scale_before = scaler.get_scale()
        # Lightning steps per-step schedulers right after optimizer_step with no hook in between (Lightning#5558),
        # so we remember their state here and roll them back in on_train_batch_end if the scaler skipped the step.
        self._snapshots = [
            (
                config.scheduler,
                copy.deepcopy(config.scheduler.state_dict()),
                [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups],
            )
            for config in trainer.lr_scheduler_configs
            if config.interval == "step" and getattr(config.scheduler, "optimizer", None) is optimizer
        ]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        logging_step = is_logging_step(trainer)
        scaler = grad_scaler(trainer)
        if scaler is not None and self._scale_before is not None:
            # A host read per step, but only with a GradScaler: its step() reads found_inf on the host every step
            # (in a plain PyTorch loop too), so the device queue is already drained here.
            scale = scaler.get_scale()
            # GradScaler.update() lowers the scale exactly when it found inf/NaN gradients and skipped the step.
            if scale < self._scale_before:
                self.skipped_steps += 1
                self._undo_scheduler_steps()
                self._report_overflow(trainer.global_step, scale)
            self._scale_before = None
            self._snapshots = []
            if logging_step:
                pl_module.log("amp/loss_scale", scale, on_step=True, on_epoch=False)
                pl_module.log("amp/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
        if self.max_nonfinite_steps is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            # counted on the device: the consecutive non-finite losses so far and the longest such run
            finite = torch.isfinite(loss.detach()).all()
            self._run = torch.where(finite, 0, self._run.to(finite.device) + 1)
            self._longest = torch.maximum(self._longest.to(finite.device), self._run)
            self._last_loss = loss.detach()
        saving = _checkpoint_may_save(trainer)
        if logging_step or saving:
            self._check(trainer, pl_module, before_save=saving)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer, pl_module, before_save=True)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # ModelCheckpoint saves here, after this callback; a weights-only save calls no on_save_checkpoint
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._check(trainer, pl_module, before_save=True)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # every rank builds every checkpoint (Lightning's contract for save_checkpoint), so all of them agree here
        if trainer.state.fn == TrainerFn.FITTING:
            self._check(trainer, pl_module, before_save=True)

    def _undo_scheduler_steps(self) -> None:
        for scheduler, state, groups in self._snapshots:
            scheduler.load_state_dict(state)
            # the lr comes from the restored schedule, not from the snapshot: inside optimizer_step the lr may be
            # temporarily scaled (the classifier's warmup), and that must not stick
            last_lrs = scheduler.get_last_lr() if hasattr(scheduler, "get_last_lr") else [g["lr"] for g in groups]
            for group, saved, lr in zip(scheduler.optimizer.param_groups, groups, last_lrs, strict=True):
                group.update({k: v for k, v in saved.items() if k != "lr"})  # e.g. OneCycleLR's momentum
                group["lr"] = lr

    def _report_overflow(self, step: int, scale: float) -> None:
        self._unreported += 1
        if self._last_message_step is not None and step - self._last_message_step < self.message_interval_steps:
            return
        more = self._unreported - 1
        message = f"Gradient overflow at step {step}. Skipping step, loss scaler reducing loss scale to {scale:g}"
        if more:
            message += f" ({more} more overflow(s) since the last message)"
        self.overflow_messages.append(message)
        rank_zero_info(message)
        self._last_message_step, self._unreported = step, 0

    def _check(self, trainer: Trainer, pl_module: LightningModule, before_save: bool = False) -> None:
        """Reads the counters (a host read: on logging steps, at the epoch's end and before a checkpoint is built)
        and stops every rank when any rank saw ``max_nonfinite_steps`` consecutive non-finite losses. One rank alone
        must never stop: the others would wait for it in the next collective forever."""
        if self.max_nonfinite_steps is None:
            return
        run, longest = (int(v) for v in torch.stack([self._run, self._longest.to(self._run.device)]).tolist())
        if not trainer.strategy.reduce_boolean_decision(longest >= self.max_nonfinite_steps, all=False):
            if before_save and run > 0:  # below the limit, but the weights about to be saved follow a non-finite loss
                self._saved_after_nonfinite = trainer.global_step
            return
        raise NonFiniteLossError(self._diagnosis(trainer, pl_module, max(longest, self.max_nonfinite_steps), run))

    def _diagnosis(self, trainer: Trainer, pl_module: LightningModule, longest: int, run: int) -> str:
        names = [
            name
            for name, p in pl_module.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "") if names else "none"
        step = trainer.global_step
        # the run is still going on (NaN weights stay NaN), or it ended before this check (read every logging step)
        steps = f"steps {step - run + 1}..{step}" if run >= longest else f"ending before step {step - run + 1}"
        loss = self._last_loss
        return (
            f"the training loss was not finite for {longest} consecutive steps "
            f"({steps}, precision {trainer.precision}); loss on rank {trainer.global_rank} at step "
            f"{step}: {None if loss is None else loss.item()}. Parameters with non-finite gradients: {shown}. "
            f"{self._checkpoints_said()} Fix: lower the learning rate, clip gradients "
            "(--trainer.gradient_clip_val 1.0), prefer precision bf16-mixed over 16-mixed, and check the inputs for "
            "NaNs. To tolerate more steps raise max_nonfinite_steps of the AMPHealth callback in trainer.callbacks."
        )

    def _checkpoints_said(self) -> str:
        """What the stop means for the checkpoints, true in each case."""
        if self._saved_after_nonfinite is None:
            return (
                "Training was stopped before saving NaN weights; the last checkpoint is untouched "
                "(resume with --ckpt_path last)."
            )
        return (
            f"Training was stopped, but a checkpoint may have been saved at step {self._saved_after_nonfinite}, just "
            "after a non-finite loss (below the limit then): resume from a checkpoint saved before it, not the last."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


def _checkpoint_may_save(trainer: Trainer) -> bool:
    """Whether a ModelCheckpoint may save at the end of this training batch (by step count or by time)."""
    for callback in trainer.checkpoint_callbacks:
        every = getattr(callback, "_every_n_train_steps", 0)
        if (every and trainer.global_step % every == 0) or getattr(callback, "_train_time_interval", None):
            return True
    return False
