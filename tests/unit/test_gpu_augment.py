"""TrivialAugmentWide batched on the device (datamodules/gpu_augment.py): each operation equals torchvision's own
kernel on each image (the CPU path's kernels when it hands over tensors), and a batch is augmented without a tensor
built from Python numbers, a value read back or a data-dependent shape: nothing that would wait for the GPU."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms import v2

from datamodules.augment import MEAN_LEVELS, apply_trivial_augment, erase_batch, trivial_augment
from datamodules.gpu_augment import OPS, BatchAugment
from tests.unit.test_imagenet import photos  # noqa: F401  (the real-photo ImageFolder fixture)

SIDE = 96


@pytest.fixture(scope="module")
def crops(photos) -> torch.Tensor:  # noqa: F811
    """uint8 [6, 3, SIDE, SIDE]: square crops of real photos, as the training crop hands them over."""
    paths = sorted(photos.glob("train/*/*.jpg"))[:6]
    crop = v2.Compose([v2.PILToTensor(), v2.Resize(SIDE, antialias=True), v2.CenterCrop(SIDE)])
    return torch.stack([crop(Image.open(path).convert("RGB")) for path in paths])


@pytest.mark.parametrize("name", [name for name in OPS if name != "Identity"])
def test_each_operation_is_torchvisions_kernel_on_each_image(crops, name):
    augment = trivial_augment()
    magnitudes_fn, signed = augment._AUGMENTATION_SPACE[name]
    bins = magnitudes_fn(augment.num_magnitude_bins, SIDE, SIDE)
    picks = [0.0] if bins is None else [float(bins[k]) for k in (1, 7, 15, 20, 30)]
    picks += [-m for m in picks if signed and m]
    op = OPS.index(name)
    batch = crops.repeat(len(picks), 1, 1, 1)  # every photo with every magnitude, in one batch
    magnitudes = torch.tensor(picks).repeat_interleave(len(crops))
    got = BatchAugment(torch.device("cpu"))(
        batch.permute(0, 2, 3, 1).float(), torch.full((len(batch),), op), magnitudes
    )
    expected = torch.stack([
        apply_trivial_augment(augment, image, op, float(m)) for image, m in zip(batch, magnitudes, strict=True)
    ]).permute(0, 2, 3, 1).float()  # fmt: skip
    levels = (got - expected).abs()
    # float rounding of a sampling grid or a blend can move a value across a rounding step: one level, rarely
    assert levels.max() <= 1 and (levels > 0).float().mean() < 0.01, (name, levels.max(), (levels > 0).float().mean())


def test_not_augmented_images_pass_unchanged(crops):
    images = crops.permute(0, 2, 3, 1).float() + 0.25  # a resize's fractional levels: left as they are
    ops = torch.tensor([-1, 0, -1, 0, -1, 0])
    out = BatchAugment(torch.device("cpu"))(images, ops, torch.zeros(6))
    assert torch.equal(out[ops == -1], images[ops == -1])
    assert torch.equal(out[ops == 0], images[ops == 0].round())  # Identity: the uint8 levels the CPU path hands over


class HostTraffic(TorchDispatchMode):
    """Every aten call that builds a tensor from Python data (``lift_fresh``: ``torch.tensor(list)``), reads a value
    back to the host (``_local_scalar_dense``: ``.item()``, ``bool()``), has a data-dependent shape (``nonzero``,
    masked indexing) or copies between devices (``_to_copy`` to another device)."""

    WAITS = {"aten::lift_fresh", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique"}

    def __init__(self):
        super().__init__()
        self.calls, self.waits = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.calls.append(name)
        moved = name == "aten::_to_copy" and kwargs.get("device") not in (None, args[0].device)
        if name in self.WAITS or moved:
            self.waits.append(name)
        return func(*args, **kwargs)


def test_a_batch_is_augmented_without_host_traffic(crops):
    """A batch of 16 with every operation drawn: the parameters are one tensor per batch, already on the device."""
    images = crops.repeat(3, 1, 1, 1)[:16].permute(0, 2, 3, 1).float()
    ops, magnitudes = torch.arange(16) % len(OPS) - 1, torch.linspace(-0.9, 0.9, 16)  # -1 (none) and all 14
    boxes = torch.tensor([[8, 8, 20, 30]] * 16)
    augment, value = BatchAugment(torch.device("cpu")), torch.tensor(MEAN_LEVELS, dtype=torch.float32)
    with HostTraffic() as traffic:
        erase_batch(augment(images, ops, magnitudes), boxes, value)
    assert traffic.waits == [] and "aten::grid_sampler_2d" in traffic.calls, traffic.waits
    assert traffic.calls.count("aten::grid_sampler_2d") == 1  # one sampling for every geometric operation
