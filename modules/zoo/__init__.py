"""Network zoo: a name -> ``nn.Module`` factory. ``mnist_cnn``, ``mnist_fast`` and every torchvision classification
architecture.

A new model touches this package only: add a factory to ``FACTORIES``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torchvision
from torch import nn

from app.errors import UserError
from modules.zoo.mnist_cnn import mnist_cnn
from modules.zoo.mnist_fast import mnist_fast

FACTORIES: dict[str, Callable[..., nn.Module]] = {"mnist_cnn": mnist_cnn, "mnist_fast": mnist_fast}


def available() -> list[str]:
    """All valid ``--model.arch`` names."""
    return sorted(FACTORIES) + torchvision.models.list_models(module=torchvision.models)


def _adapt_input_channels(net: nn.Module, in_channels: int) -> None:
    """Replaces the first 3-channel convolution by one taking ``in_channels`` (e.g. 1 for grayscale)."""
    for name, module in net.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.in_channels == in_channels:
                return
            conv = nn.Conv2d(
                in_channels,
                module.out_channels,
                module.kernel_size,
                module.stride,
                module.padding,
                module.dilation,
                module.groups,
                module.bias is not None,
                module.padding_mode,
            )
            with torch.no_grad():  # keep pretrained filters meaningful: average them over the RGB channels
                conv.weight.copy_(module.weight.mean(dim=1, keepdim=True).expand_as(conv.weight))
                if module.bias is not None:
                    conv.bias.copy_(module.bias)
            parent_name, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent_name) if parent_name else net, child, conv)
            return


class UnknownArchError(UserError, ValueError):
    """``model.arch`` names no network; the message suggests the closest names and lists all."""


def build(arch: str, num_classes: int, in_channels: int = 3, **kwargs) -> nn.Module:
    """Builds network ``arch`` for ``num_classes`` outputs and ``in_channels`` input channels.

    Raises:
        UnknownArchError: the name is unknown; the message suggests the closest and lists the valid names.
    """
    if arch in FACTORIES:
        return FACTORIES[arch](num_classes=num_classes, in_channels=in_channels, **kwargs)
    if arch not in torchvision.models.list_models(module=torchvision.models):
        import difflib

        near = difflib.get_close_matches(arch, available(), n=3, cutoff=0.6)
        raise UnknownArchError(
            f"Unknown model.arch {arch!r}. Fix: --model.arch {near[0] if near else 'mnist_cnn'}"
            + (f" (closest: {', '.join(near)})" if near else "")
            + f". Valid names: {', '.join(available())}"
        )
    net = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    if in_channels != 3:
        _adapt_input_channels(net, in_channels)
    return net
