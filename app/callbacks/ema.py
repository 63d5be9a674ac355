"""An exponential moving average of the weights: Lightning's ``EMAWeightAveraging`` with torchvision's recipe rules.

Lightning's callback keeps the average (parameters and buffers, on the training device), swaps it in for every
validation (so ``val/acc1``, and with it the "best" checkpoint, are the average's), copies it into the model when
the fit ends (so a test after fit tests it), and saves it in every checkpoint as ``state_dict`` with the training
weights beside it (``current_model_state``) and its own state (``averaging_state``): a resume restores both, and
``cli.py test --ckpt_path`` or ``--model.weights`` read the average.

What this subclass adds, each a few lines:

- ``torchvision_decay``: torchvision's reference recipe (references/classification/train.py) gives a decay per
  image-epoch (``--model-ema-decay 0.99998``) and adjusts it to the run, ``1 - (1 - decay) x world size x
  per-device batch x steps between updates / epochs``, so that the average spans the same share of any run (0.99891
  at 8 x 128 over 600 epochs); it updates after the steps whose index *within the epoch* is a multiple of
  ``update_every_n_steps`` (the first step of every epoch included), and during the model's warm-up epochs the
  average restarts at each update (a copy of the weights), as there;
- evaluating or testing a checkpoint outside ``fit`` (``--test_after_fit`` included) uses its ``state_dict``, the
  average, without Lightning's warning (Lightning's would load the training weights back when the same callback has
  just finished a fit);
- the averaged copy lives on the training device from the start (Lightning's copies the module while it is still
  on the host);
- the average goes into the model when the fit ends, not when training ends: a ``last.ckpt`` saved as training ends
  (by the checkpoint callback, which runs after this one) keeps the training weights beside the average.

It is the first callback of a run (``app.command.default_callbacks``): the average includes a step before any callback
saves a checkpoint at that step's end, so a run stopped there and resumed averages the same steps.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.optim.swa_utils import get_ema_avg_fn

from core.batch import torchvision_adjusted


class EMA(EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging``, configured by the ``--ema`` group (``--ema.decay 0.999``, or the modern
    recipe's ``--ema.torchvision_decay 0.99998 --ema.update_every_n_steps 32``); off unless one decay is given.

    Args:
        decay: the decay per update, as Lightning's.
        torchvision_decay: torchvision's ``--model-ema-decay``, adjusted to the run at its start
            (:func:`torchvision_adjusted`); during the model's ``warmup_epochs`` the average restarts at each update.
        update_every_n_steps: optimizer steps between updates.
        update_starting_at_step: no update before this optimizer step (Lightning's).
    """

    def __init__(
        self,
        decay: float | None = None,
        torchvision_decay: float | None = None,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
    ) -> None:
        super().__init__(
            decay=decay or 0.999,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
        )
        self.decay, self.torchvision_decay = decay, torchvision_decay
        self.effective_decay: float | None = decay
        self._warmup_epochs = 0.0
        self._epoch_step = 0

    @property
    def enabled(self) -> bool:
        """Whether a decay was given: the CLI adds the callback only then."""
        return self.decay is not None or self.torchvision_decay is not None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.torchvision_decay is not None:
            # torchvision's world size x per-device batch: the images of one batch over all processes (its loop
            # has no gradient accumulation; under dp the process's batch holds every GPU's share)
            known = getattr(trainer.datamodule, "global_batch_size", None)
            per_device = getattr(trainer.datamodule, "batch_size", None) or 1
            images = known // trainer.accumulate_grad_batches if known else trainer.world_size * int(per_device)
            epochs = max(trainer.max_epochs or 1, 1)
            every = self.update_every_n_steps
            self.effective_decay = torchvision_adjusted(self.torchvision_decay, int(images), every, epochs)
            self._warmup_epochs = float(pl_module.hparams.get("warmup_epochs") or 0.0)
            restart = "; restarted at each update of the warm-up epochs" if self._warmup_epochs else ""
            rank_zero_info(
                f"ema: decay {self.effective_decay:.6g} per update at the steps 0, {every}, {2 * every}, .. of each "
                f"epoch = torchvision's {self.torchvision_decay:g} adjusted to {images} images per batch x {every} / "
                f"{epochs} epochs{restart}"
            )
        self._kwargs["avg_fn"] = get_ema_avg_fn(decay=self.effective_decay)
        self._device = self._device or trainer.strategy.root_device
        super().setup(trainer, pl_module, stage)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Lightning's rule (every ``update_every_n_steps`` optimizer steps of the run), or with ``torchvision_decay``
        torchvision's: the step's index within its epoch is a multiple of ``update_every_n_steps``."""
        if self.torchvision_decay is None or step_idx is None:
            return super().should_update(step_idx, epoch_idx)
        started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
        return started and self._epoch_step % self.update_every_n_steps == 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        batch_idx = args[-1]  # (outputs, batch, batch_idx): this optimizer step's index within the epoch
        self._epoch_step = (batch_idx + 1) // trainer.accumulate_grad_batches - 1
        updated = self._latest_update_step
        super().on_train_batch_end(trainer, pl_module, *args)
        warming_up = trainer.current_epoch < self._warmup_epochs
        if warming_up and self._latest_update_step != updated and self._average_model is not None:
            self._average_model.n_averaged.zero_()  # the next update copies the weights (torchvision's reset)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """A strategy that keeps each rank's BatchNorm statistics and averages them at every checkpoint (``allreduce``:
        its ``sync_buffers``) has the average's averaged too: the average takes them from its own rank at each update,
        so a run resumed from the checkpoint (whose ranks start from the averaged statistics) matches one never stopped
        to rounding. A collective: every rank builds the checkpoint."""
        if self._average_model is not None and callable(getattr(trainer.strategy, "sync_buffers", None)):
            trainer.strategy.sync_buffers(self._average_model.module)
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Not yet: a checkpoint saved as training ends (``last.ckpt`` when that step had none) must still hold the
        training weights beside the average; the average goes into the model when the fit ends."""

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._average_model is not None:
            self._copy_average_to_current(pl_module)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
        # validate/test/predict: the model evaluates the checkpoint's state_dict, which is the average
