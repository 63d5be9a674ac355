"""Pretrained weights (``--model.weights``): a torchvision weights name or a file, read for :func:`modules.zoo.build`.

- A name (``IMAGENET1K_V2``, ``DEFAULT``; ``ResNet50_Weights.IMAGENET1K_V2`` also works) is looked up in
  ``torchvision.models.get_model_weights(arch)`` and built by ``torchvision.models.get_model(arch, weights=...)``,
  which reads ``$TORCH_HOME/hub/checkpoints/<basename of the weights' url>`` (``torch.hub.get_dir()``) and downloads
  it there when it is missing. torch.hub downloads into a uniquely named ``.partial`` file and renames it when
  complete, so ranks that download at the same time never read or write a half-written file.
- A file (``.pth``, ``.pt``, ``.ckpt`` ...) holds a state dict of the same ``arch``, as ``torch.save(net.state_dict())``
  writes it, or is a checkpoint of this app, whose ``state_dict`` entries under ``net.`` are taken. Its number of
  classes and input channels are read from the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from core.errors import UserError, closest

FILE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin", ".tar")


class WeightsError(UserError, ValueError):
    """``model.weights`` names no weights of the architecture, or its file is missing or does not fit."""


def is_file(weights: str) -> bool:
    """Whether ``weights`` names a file rather than a torchvision weights name."""
    return os.path.exists(weights) or os.sep in weights or weights.endswith(FILE_SUFFIXES)


def named(arch: str, name: str) -> torchvision.models.WeightsEnum:
    """The torchvision weights ``name`` of ``arch`` (``DEFAULT`` too).

    Raises:
        WeightsError: ``arch`` has no torchvision weights, or ``name`` is not one of them (the message lists them).
    """
    try:
        enum = torchvision.models.get_model_weights(arch)
    except ValueError:
        raise WeightsError(
            f"model.weights {name!r}: {arch} has no torchvision weights names. Fix: give a file saved from a {arch} "
            f"(--model.weights path/to/weights.pth), or choose a torchvision --model.arch such as resnet50."
        ) from None
    key = name.removeprefix(f"{enum.__name__}.")
    if key not in enum.__members__:
        near = closest(key, enum.__members__)
        raise WeightsError(
            f"Unknown model.weights {name!r} for {arch}"
            + (f" (did you mean {near[0]}?)" if near else "")
            + f". Valid names for {arch}: {', '.join(enum.__members__)}; or a file: --model.weights path/to/file.pth"
        )
    return enum[key]


def cache_path(weights: torchvision.models.WeightsEnum) -> Path:
    """Where ``torch.hub`` keeps (and looks for) the file of ``weights``: ``$TORCH_HOME/hub/checkpoints/<name>``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def torchvision_pretrained(arch: str, name: str, **kwargs) -> nn.Module:
    """``arch`` with the torchvision weights ``name``, read from torch.hub's cache or downloaded into it.

    Raises:
        WeightsError: the file is neither in the cache nor downloadable (the message names the file, the folder and
            the ``wget`` command that fills it), or the cached file cannot be read.
    """
    weights = named(arch, name)
    cached = cache_path(weights)
    try:
        return torchvision.models.get_model(arch, weights=weights, **kwargs)
    except (OSError, RuntimeError, EOFError) as err:  # urllib's URLError is an OSError; a bad hash a RuntimeError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if cached.is_file():  # not a download problem: the file there is damaged
            raise WeightsError(
                f"model.weights {name}: {cached} cannot be read as {arch} weights ({reason}). Fix: delete it and "
                f"put the file from {weights.url} there again (`wget {weights.url} -P {cached.parent}`)."
            ) from None
        raise WeightsError(
            f"model.weights {name}: {arch}'s file {cached} is missing and could not be downloaded ({reason}). Fix: "
            f"put it there: `wget {weights.url} -P {cached.parent}` where there is network, or copy {cached.name} "
            f"from a machine that has it (in its ~/.cache/torch/hub/checkpoints/); or set TORCH_HOME to a folder "
            f"whose hub/checkpoints/ holds it."
        ) from None


def read_file(path: str) -> dict[str, torch.Tensor]:
    """The network's state dict from ``path``: a plain state dict, or the ``net.`` part of a checkpoint's.

    Raises:
        WeightsError: the file is missing or unreadable.
    """
    if not os.path.isfile(path):
        raise WeightsError(
            f"model.weights file {path} does not exist. Fix: give the path of a saved state dict or checkpoint, "
            f"or a torchvision weights name such as IMAGENET1K_V1."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (any unpickling failure: the file is not a tensor state dict)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise WeightsError(
            f"model.weights file {path} cannot be read as a state dict ({reason}). Fix: save the weights with "
            f"torch.save(net.state_dict(), path), or give a checkpoint of this app."
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # a Lightning checkpoint
        state = {k.removeprefix("net."): v for k, v in state["state_dict"].items() if k.startswith("net.")}
    if not isinstance(state, dict) or not state:
        raise WeightsError(
            f"model.weights file {path} holds no network weights. Fix: save them with torch.save(net.state_dict(), "
            f"path), or give a checkpoint of this app."
        )
    return state


def load_into(net: nn.Module, state: dict[str, torch.Tensor], arch: str, path: str) -> None:
    """Loads ``state`` into ``net``, refusing a file of another architecture with one line that says what differs."""
    own = net.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        details = "; ".join(
            f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", wrong))
            if keys
        )
        raise WeightsError(
            f"model.weights file {path} does not hold {arch} weights ({details}). Fix: --model.arch set to the "
            f"network the file was saved from, or a file saved from a {arch}."
        )
    net.load_state_dict(state)
