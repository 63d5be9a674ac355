"""The DataModule contract: what the app and the model read from a data set's ``LightningDataModule``.

A new data set is one file in ``datamodules/`` (or any importable module, named by ``data.class_path``) whose class
meets :class:`ImageData`; ``datamodules.base.ImageDataModule`` gives the batch semantics, exact evaluation, the
resumable training loader and the defaults below, so a subclass states only its data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class ImageData(Protocol):
    """An image-classification DataModule as the app uses it.

    - ``num_classes`` and ``in_channels`` are linked to the model's (``model.num_classes``, ``model.in_channels``)
      by the CLI: the model is told, never configured twice.
    - ``input_shape``: one image, channels first, the model summary's example input (its FLOPs column); None: none.
    - ``random_transforms``: True when the training transforms draw random numbers (crops, flips); the training
      loader then seeds each sample from (seed, epoch, sample), so a resumed run draws the same ones.
    - ``batch_size``: images per device and step; ``global_batch_size``: images per optimizer step over all
      processes, known once ``setup`` ran under a Trainer (``core.batch``).
    - ``config_problems(init_args)``: the class's own checks of its ``data.init_args``, run by the preflight before
      the DataModule is built (``[]``: none), each a message naming the fix.
    - ``plan_lines(init_args, cuda)``: what the plan prints of this data (where it is decoded and normalised).
    """

    num_classes: int
    in_channels: int
    input_shape: ClassVar[tuple[int, ...] | None]
    random_transforms: ClassVar[bool]
    batch_size: int

    @property
    def global_batch_size(self) -> int | None: ...

    @classmethod
    def config_problems(cls, init_args: Mapping[str, Any]) -> list[str]: ...

    @classmethod
    def plan_lines(cls, init_args: Mapping[str, Any], cuda: bool) -> list[str]: ...
