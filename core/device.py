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


def cuda_capability(cuda: bool) -> tuple[int, int] | None:
    """The compute capability of this process's CUDA device when the run is on CUDA, else None."""
    return torch.cuda.get_device_capability() if cuda and torch.cuda.is_available() else None


def precision_for(capability: tuple[int, int] | None) -> str:
    """``trainer.precision auto`` for a GPU of this compute capability (None: not on CUDA): bf16 mixed precision
    where the GPU computes bf16 (sm80, Ampere, and newer), fp16 mixed precision below (T4, V100), else 32-true.
    Not ``torch.cuda.is_bf16_supported()``: by default it counts bf16 that is only emulated (a T4 says True)."""
    if capability is None:
        return "32-true"
    return "bf16-mixed" if tuple(capability) >= (8, 0) else "16-mixed"


def precision_reason(capability: tuple[int, int] | None) -> str:
    """Why :func:`precision_for` chose as it did, for the plan."""
    if capability is None:
        return "not on CUDA"
    sm = f"sm{capability[0]}{capability[1]}"
    return f"{sm} computes bf16" if tuple(capability) >= (8, 0) else f"{sm} only emulates bf16: fp16, loss-scaled"


def auto_precision(cuda: bool) -> str:
    """``trainer.precision auto`` for this process's device (:func:`precision_for`)."""
    return precision_for(cuda_capability(cuda))


def describe(setting: str, value: Any, resolved: Any, cuda: bool, note: str = "") -> str:
    """How the plan states one choice: ``resolved (setting auto: on CUDA)`` or ``resolved (setting)``, then
    ``, note`` inside the brackets if given."""
    why = f"{setting} auto: {'on CUDA' if cuda else 'not on CUDA'}" if value == AUTO else setting
    return f"{resolved} ({why}{', ' + note if note else ''})"
