"""Lightning's ``LearningRateMonitor`` that stands aside when the run has no logger."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor as _LearningRateMonitor


class LearningRateMonitor(_LearningRateMonitor):
    """Logs ``lr-<Optimizer>`` like Lightning's; without a logger (``--trainer.logger false``) it does nothing.

    Lightning's raises ``MisconfigurationException`` at the start of training when no logger exists, so turning
    logging off would otherwise mean restating the whole default callbacks list without it.
    """

    def on_train_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._off = not trainer.loggers
        if not self._off:
            super().on_train_start(trainer, *args, **kwargs)

    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if not self._off:
            super().on_train_batch_start(trainer, *args, **kwargs)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if not self._off:
            super().on_train_epoch_start(trainer, *args, **kwargs)
