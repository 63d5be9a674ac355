"""When the app reads values off the device during training: Lightning's logging steps, nothing in between.

A training step that reads a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``) waits for everything
queued on the device, so the host can no longer run ahead of it; and every ``self.log`` call costs Lightning's result
bookkeeping (~0.3 ms of Python each, ``bench/step_profile.py``). So the app's per-step figures (``train/*``, ``perf/*``,
``amp/*``) are logged only on the steps whose values Lightning writes to the loggers anyway, plus the last batch of
each epoch so the epoch's final values are current; on the other steps they are only accumulated on the device.
"""

from __future__ import annotations

from lightning.pytorch import Trainer


def is_logging_step(trainer: Trainer) -> bool:
    """Whether this training batch's logged values reach the loggers: every ``trainer.log_every_n_steps`` optimizer
    steps (Lightning's own test, ``_LoggerConnector.should_update_logs``), under ``fast_dev_run``, or the epoch's last
    batch (the values that remain in the progress bar and ``trainer.callback_metrics`` until the next epoch)."""
    if trainer.fast_dev_run:
        return True
    if trainer._logger_connector.should_update_logs:  # private, but Lightning's one definition of a logging step
        return True
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
