"""DataModules for the tasks the app trains. Each exposes ``num_classes`` and ``in_channels`` for the model."""

from datamodules.mnist import MNISTDataModule

__all__ = ["MNISTDataModule"]
