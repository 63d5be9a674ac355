"""Loggers whose ``save_dir`` may be left out: the CLI then points them at ``trainer.default_root_dir``,
so a run's events, config and checkpoints share one folder that one option moves."""

from __future__ import annotations

from lightning.pytorch import loggers


class TensorBoardLogger(loggers.TensorBoardLogger):
    """Lightning's TensorBoardLogger; ``save_dir=None`` means the run folder (``trainer.default_root_dir``)."""

    def __init__(self, save_dir: str | None = None, name: str | None = "", **kwargs) -> None:
        super().__init__(save_dir=save_dir or ".", name=name, **kwargs)
