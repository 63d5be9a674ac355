"""Network zoo: a name -> ``nn.Module`` factory. ``mnist_cnn``, ``mnist_fast``, ``mnist_lenet``, ``tutorial_net``
and every torchvision classification architecture, randomly initialised or with pretrained weights
(:mod:`modules.zoo.weights`).

A new model touches this package only: add a factory to ``FACTORIES``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torchvision
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from core.errors import UserError
from modules.zoo import weights as zoo_weights
from modules.zoo.mnist_cnn import mnist_cnn
from modules.zoo.mnist_fast import mnist_fast
from modules.zoo.mnist_lenet import mnist_lenet
from modules.zoo.tutorial_net import tutorial_net

FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "mnist_cnn": mnist_cnn,
    "mnist_fast": mnist_fast,
    "mnist_lenet": mnist_lenet,
    "tutorial_net": tutorial_net,
}


def available() -> list[str]:
    """All valid ``--model.arch`` names."""
    return sorted(FACTORIES) + torchvision.models.list_models(module=torchvision.models)


def first_conv(net: nn.Module) -> tuple[str, nn.Conv2d]:
    """The name and module of the network's first convolution (the one that sees the image)."""
    return next((name, m) for name, m in net.named_modules() if isinstance(m, nn.Conv2d))


def head(net: nn.Module) -> tuple[str, nn.Linear | nn.Conv2d]:
    """The name and module of the classifier head: the last ``Linear`` (``fc``, ``classifier[-1]``, ``heads.head``),
    or the last convolution for networks without one (SqueezeNet's ``classifier[1]``)."""
    layers = [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    return (layers or [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Conv2d)])[-1]


def _replace(net: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, child, module)


def _adapt_input_channels(net: nn.Module, in_channels: int, pretrained: bool = False) -> None:
    """Replaces the first convolution by one taking ``in_channels`` (e.g. 1 for grayscale).

    Random weights are averaged over the old input channels. Pretrained ones are summed and divided by the new
    count, so that an image whose channels are all equal gives the activations it gave as an RGB image (3 -> 1: the
    RGB kernels summed): the pretrained features survive.
    """
    name, module = first_conv(net)
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
    with torch.no_grad():
        merged = module.weight.sum(dim=1, keepdim=True) / in_channels if pretrained else module.weight.mean(1, True)
        conv.weight.copy_(merged.expand_as(conv.weight))
        if module.bias is not None:
            conv.bias.copy_(module.bias)
    _replace(net, name, conv)
    if pretrained:
        how = "summed" if in_channels == 1 else f"summed and divided by {in_channels}"
        rank_zero_info(
            f"model.weights: first convolution {name} adapted from {module.in_channels} to {in_channels} input "
            f"channels, the pretrained kernels {how} (an image with equal channels gives the pretrained activations)"
        )


def _fit_head(net: nn.Module, num_classes: int, source: str) -> None:
    """Replaces the head by a new, randomly initialised one when the pretrained one has another number of classes."""
    name, old = head(net)
    classes = old.out_features if isinstance(old, nn.Linear) else old.out_channels
    if classes == num_classes:
        return
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride, old.padding)
    _replace(net, name, new)
    rank_zero_info(
        f"model.weights {source}: classifier head {name} replaced, {classes} -> {num_classes} classes "
        f"(new layer, randomly initialised; fine-tuning trains it with the rest)"
    )


class UnknownArchError(UserError, ValueError):
    """``model.arch`` names no network; the message suggests the closest names and lists all."""

    help = "unknown-arch"


def _random(arch: str, num_classes: int, in_channels: int, **kwargs) -> nn.Module:
    if arch in FACTORIES:
        return FACTORIES[arch](num_classes=num_classes, in_channels=in_channels, **kwargs)
    net = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    _adapt_input_channels(net, in_channels)
    return net


def _from_file(arch: str, path: str, num_classes: int, in_channels: int, **kwargs) -> nn.Module:
    """``arch`` with the weights of file ``path``, built for the classes and input channels the file has."""
    state = zoo_weights.read_file(path)
    net = _random(arch, num_classes, in_channels, **kwargs)
    head_key, conv_key = f"{head(net)[0]}.weight", f"{first_conv(net)[0]}.weight"
    if head_key in state and conv_key in state:
        shape = (state[head_key].shape[0], state[conv_key].shape[1] * first_conv(net)[1].groups)
        if shape != (num_classes, in_channels):
            net = _random(arch, *shape, **kwargs)
    zoo_weights.load_into(net, state, arch, path)  # a file of another network: one line naming what differs
    return net


def build(arch: str, num_classes: int, in_channels: int = 3, weights: str | None = None, **kwargs) -> nn.Module:
    """Builds network ``arch`` for ``num_classes`` outputs and ``in_channels`` input channels.

    ``weights``: None (random), a torchvision weights name of ``arch`` (``IMAGENET1K_V2``, ``DEFAULT``) or a file
    (:mod:`modules.zoo.weights`). A pretrained head with another number of classes is replaced by a new one, and the
    first convolution adapted to ``in_channels``; each says so in one log line.

    Raises:
        UnknownArchError: the name is unknown; the message suggests the closest and lists the valid names.
        WeightsError: ``weights`` is unknown for ``arch``, missing offline, or a file that does not fit.
    """
    if arch not in FACTORIES and arch not in torchvision.models.list_models(module=torchvision.models):
        import difflib

        near = difflib.get_close_matches(arch, available(), n=3, cutoff=0.6)
        raise UnknownArchError(
            f"Unknown model.arch {arch!r}. Fix: --model.arch {near[0] if near else 'mnist_cnn'}"
            + (f" (closest: {', '.join(near)})" if near else "")
            + f". Valid names: {', '.join(available())}"
        )
    if not weights:
        return _random(arch, num_classes, in_channels, **kwargs)
    if zoo_weights.is_file(weights):
        net = _from_file(arch, weights, num_classes, in_channels, **kwargs)
    else:
        net = zoo_weights.torchvision_pretrained(arch, weights, **kwargs)
    rank_zero_info(f"model.weights: {arch} starts from {weights}")
    _fit_head(net, num_classes, weights)
    _adapt_input_channels(net, in_channels, pretrained=True)
    return net
