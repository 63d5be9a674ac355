"""DataModules for the tasks the app trains. Each exposes ``num_classes`` and ``in_channels`` for the model.

The classes are imported on first use (PEP 562), so that ``python -m datamodules.imagenet_val`` starts without
importing torch and Lightning; ``from datamodules import MNISTDataModule`` and ``class_path:`` entries work as usual.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datamodules.imagenet import ImageNetDataModule
    from datamodules.mnist import MNISTDataModule

_WHERE = {"ImageNetDataModule": "datamodules.imagenet", "MNISTDataModule": "datamodules.mnist"}
__all__ = ["ImageNetDataModule", "MNISTDataModule"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
