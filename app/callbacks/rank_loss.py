"""Each rank's mean training loss per epoch, printed the way the PyTorch distributed tutorial prints it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class RankEpochLoss(Callback):
    """At the end of each training epoch every rank prints its own line, ``Rank  0 , epoch  0 :  1.23``: the mean of
    the training losses of its own batches, as the synchronous SGD example of "Writing Distributed Applications with
    PyTorch" prints it. The values of all ranks are also sent to the loggers, as ``train/epoch_loss_rank<R>``.

    The losses are summed on the device: a step adds no host read and no collective. The epoch end reads one number
    and gathers one per rank (for the logger, which writes from rank 0). A resume mid-epoch counts from the resume.
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sum, self._count = None, 0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        loss = loss.detach().float()
        self._sum = loss.clone() if self._sum is None else self._sum.add_(loss)
        self._count += 1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mean = self._sum / self._count if self._count else torch.tensor(float("nan"), device=pl_module.device)
        # the tutorial's line, print('Rank ', dist.get_rank(), ', epoch ', epoch, ': ', epoch_loss / num_batches),
        # written at once: the ranks share the terminal, and print's separate writes would interleave
        sys.stdout.write(f"Rank  {trainer.global_rank} , epoch  {trainer.current_epoch} :  {mean.item()}\n")
        sys.stdout.flush()
        # every rank's value in its own slot, summed: one collective, in which every rank takes part
        slots = torch.zeros(trainer.world_size, device=mean.device)
        slots[trainer.global_rank] = mean
        every_rank = trainer.strategy.reduce(slots, reduce_op="sum").tolist()
        if trainer.is_global_zero:  # straight to the loggers: the values are already every rank's, not to be reduced
            for logger in trainer.loggers:
                metrics = {f"train/epoch_loss_rank{r}": v for r, v in enumerate(every_rank)}
                logger.log_metrics(metrics, step=trainer.global_step)
