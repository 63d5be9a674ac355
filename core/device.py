"""The GPU defaults of a recipe: what ``auto`` means for precision, memory format, compile, where the batch is
normalised and decoded, decided the same way by the plan (before anything is built) and by the run.

A recipe that wants a setting on CUDA only writes ``auto`` (``configs/imagenet.yaml``: ``trainer.precision``,
``model.channels_last``, ``model.compile``, ``data.normalize_on_device``, ``data.decode``); a user who gives a value
keeps it. On CUDA ``auto`` is the fast choice, anywhere else the portable one.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

AUTO = "auto"
Auto = Literal["auto"]


def on_cuda(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` puts the run on CUDA: ``cuda``/``gpu``, or ``auto`` where CUDA is available
    (Lightning's own choice for ``auto``), or a CUDA accelerator instance."""
    if accelerator is None or isinstance(accelerator, str):
        name = (accelerator or AUTO).lower()
        return name in ("cuda", "gpu") or (name == AUTO and torch.cuda.is_available())
    return "cuda" in type(accelerator).__name__.lower()


def flag(value: bool | str, cuda: bool) -> bool:
    """A ``bool | auto`` setting resolved: ``auto`` is on exactly on CUDA."""
    return cuda if value == AUTO else bool(value)


def auto_precision(cuda: bool) -> str:
    """``trainer.precision auto``: bf16 mixed precision on a CUDA GPU that has bf16 (Ampere and newer), else 32-true."""
    return "bf16-mixed" if cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def describe(setting: str, value: Any, resolved: Any, cuda: bool) -> str:
    """How the plan states one choice: ``resolved (setting auto: on CUDA)`` or ``resolved (setting)``."""
    why = f"{setting} auto: {'on CUDA' if cuda else 'not on CUDA'}" if value == AUTO else setting
    return f"{resolved} ({why})"
