"""The ImageNet transforms: the classic ones and the modern recipe's (torchvision's reference recipe of 2021).

Per image, in this order: ``RandomResizedCrop`` + horizontal flip, ``TrivialAugmentWide`` (bilinear, as torchvision's
reference), then to tensor and, after normalising, ``RandomErasing``; evaluation: resize, centre crop. Per batch, on
the device: ``MixUp`` or ``CutMix`` (:class:`BatchMixer`). All of them are torchvision.transforms.v2's own.

What this module adds is where the random numbers come from, so that a resumed run and every input path draw the
same ones:

- the per-image draws happen under :class:`~datamodules.resumable.SeededDataset`'s per-sample seeds, in the workers,
  whatever the decoder: ``--data.decode gpu`` draws them there too (:func:`trivial_augment_draw`,
  :func:`erasing_draw`: the transforms' own calls, in the same order) and applies them on the device
  (:func:`apply_trivial_augment`, :func:`erase_batch`);
- the mixing of a batch draws from a generator seeded by (seed, epoch, batch, shard) (:func:`batch_seed`): nothing to
  save in a checkpoint beyond the loader's position, and a device's share of the batch (its *shard*) is mixed within
  itself, as torchvision's reference mixes each process's batch in its loader's ``collate_fn``.

Random erasing fills its box with the ImageNet mean (0 after normalising, the reference's ``value=0`` on normalised
images); on the uint8 paths (normalising on the device, GPU decoding) with the mean in pixel levels (124, 116, 104).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MEAN_LEVELS = tuple(round(255 * m) for m in MEAN)  # the erasing value of a uint8 image
# the mixing's options with a range: name -> (whether a value is outside it, what the option takes)
MIXING_RANGES = {
    "mixup_alpha": (lambda a: a < 0, "a Beta distribution's alpha, 0 (off) or more (0.2 in the modern recipe)"),
    "cutmix_alpha": (lambda a: a < 0, "a Beta distribution's alpha, 0 (off) or more (1.0 in the modern recipe)"),
}


def trivial_augment() -> v2.TrivialAugmentWide:
    """torchvision's reference recipe's TrivialAugmentWide: bilinear interpolation, black fill."""
    return v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)


def image_transforms(
    size: int,
    train: bool,
    uint8: bool,
    resize: int | None = None,
    trivial: bool = False,
    erasing: float = 0.0,
) -> v2.Compose:
    """The transforms of one image; output float normalised, or uint8 (normalised on the device).

    Args:
        size: the training crop (train) or the evaluation centre crop.
        train: RandomResizedCrop + flip (+ TrivialAugmentWide, random erasing), or resize + centre crop.
        uint8: hand over uint8 tensors, normalised on the device.
        resize: evaluation: the shorter side before the centre crop (default ``size / 0.875``: 256 for 224).
        trivial: TrivialAugmentWide after the flip.
        erasing: random erasing's probability (0: none).
    """
    if not train:
        short = resize or round(size / 0.875)
        geometry = [v2.Resize(short, antialias=True), v2.CenterCrop(size)]
        pixels = [v2.PILToTensor()] if uint8 else [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
        return v2.Compose([*geometry, *pixels, *([] if uint8 else [v2.Normalize(MEAN, STD)])])
    steps: list[Any] = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    steps += [trivial_augment()] if trivial else []
    if uint8:
        steps.append(v2.PILToTensor())
        steps += [v2.RandomErasing(erasing, value=list(MEAN_LEVELS))] if erasing else []
        return v2.Compose(steps)
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    steps += [v2.RandomErasing(erasing, value=0.0)] if erasing else []
    return v2.Compose(steps)


# ------------------------------------------------------------------------------------------------ GPU decoding's draws
def trivial_augment_draw(augment: v2.TrivialAugmentWide) -> tuple[int, float]:
    """The operation (its index in the augmentation space) and magnitude ``augment(image)`` would draw, with its own
    calls in its order (``TrivialAugmentWide.forward``, whose magnitudes do not depend on the image's size)."""
    space = augment._AUGMENTATION_SPACE
    name, (magnitudes_fn, signed) = augment._get_random_item(space)
    magnitudes = magnitudes_fn(augment.num_magnitude_bins, 0, 0)
    magnitude = 0.0
    if magnitudes is not None:
        magnitude = float(magnitudes[int(torch.randint(augment.num_magnitude_bins, ()))])
        if signed and torch.rand(()) <= 0.5:
            magnitude *= -1
    return list(space).index(name), magnitude


def apply_trivial_augment(augment: v2.TrivialAugmentWide, image: torch.Tensor, op: int, magnitude: float) -> Any:
    """``image`` (uint8 [3, H, W], any device) transformed by the drawn operation, as ``augment`` applies it (its own
    method: the same kernels as the workers run on the CPU path)."""
    name = list(augment._AUGMENTATION_SPACE)[op]
    return augment._apply_image_or_video_transform(
        image, name, magnitude, interpolation=augment.interpolation, fill=augment._fill
    )


def erasing_draw(erasing: v2.RandomErasing, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box ``erasing`` would erase in an image of ``size`` (top, left, height, width; height 0: none), with its
    own draws in its order (the ``p`` test, then ``make_params``)."""
    if torch.rand(1) >= erasing.p:
        return 0, 0, 0, 0
    stand_in = torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, *size)  # make_params reads only the size
    box = erasing.make_params([stand_in])
    return (box["i"], box["j"], box["h"], box["w"]) if box["v"] is not None else (0, 0, 0, 0)


def erase_batch(images: torch.Tensor, boxes: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``images`` [N, H, W, C] with each image's box (``boxes`` [N, 4]: top, left, height, width; height 0: none) set
    to ``value`` [C], in one masked write for the batch."""
    rows = torch.arange(images.shape[1], device=images.device)
    cols = torch.arange(images.shape[2], device=images.device)
    top, left, height, width = (boxes[:, k, None] for k in range(4))
    inside = ((rows >= top) & (rows < top + height))[:, :, None] & ((cols >= left) & (cols < left + width))[:, None]
    return torch.where(inside[..., None], value.to(images.dtype), images)


# ------------------------------------------------------------------------------------------------ mixing, per batch
def batch_seed(seed: int, epoch: int, batch: int, shard: int) -> int:
    """The seed of one shard's mixing in one training batch: a function of the run's seed and the position only."""
    return int(np.random.SeedSequence((seed & 0xFFFFFFFF, epoch, batch, shard, 1)).generate_state(1)[0])


class BatchMixer:
    """MixUp or CutMix (torchvision's, chosen at random with equal odds when both are on) of a training batch.

    The batch is split into ``shards`` as DataParallel splits it (``Tensor.chunk``); shard ``k`` is mixed within itself
    with the CPU generator seeded by ``batch_seed(seed, epoch, batch, first + k)`` and restored afterwards (the
    training step's own draws are those of a run without mixing). Under ``ddp`` a process's batch is its one shard,
    ``first`` its rank; under ``dp`` a process's batch is split over its devices. Labels come out as probabilities.

    Args:
        num_classes: classes (the one-hot width of the mixed labels).
        mixup_alpha: MixUp's Beta(alpha, alpha) (0: off).
        cutmix_alpha: CutMix's Beta(alpha, alpha) (0: off).
        seed: the run's seed (the training sampler's).
    """

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float, seed: int) -> None:
        choices = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
        choices += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
        if not choices:
            raise ValueError("BatchMixer needs mixup_alpha or cutmix_alpha above 0")
        self.mix = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)
        self.seed = seed

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int, first: int = 0, shards: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for k, (x, y) in enumerate(zip(images.chunk(shards), labels.chunk(shards), strict=True)):
            with torch.random.fork_rng(devices=[]):  # CPU draws only (Beta, box, choice); the state comes back
                torch.default_generator.manual_seed(batch_seed(self.seed, epoch, batch, first + k))
                parts.append(self.mix(x, y))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def range_problems(ranges: dict[str, tuple[Any, str]], init_args: Any) -> list[str]:
    """One line for each option of ``ranges`` whose value in ``init_args`` is out of its range, saying what it takes."""
    return [
        f"data.{name}={init_args[name]} is out of range: {what}."
        for name, (wrong, what) in ranges.items()
        if init_args.get(name) is not None and wrong(init_args[name])
    ]


def mixing_lines(init_args: Any) -> list[str]:
    """The plan's line for the mixing, when it is on."""
    mixup, cutmix = init_args.get("mixup_alpha") or 0.0, init_args.get("cutmix_alpha") or 0.0
    return [mixing_line(mixup, cutmix)] if mixup or cutmix else []


def recipe_lines(init_args: Any, decoder: str | None = None) -> list[str]:
    """The plan's lines for the options beyond the classic recipe, each only when it is on (``decoder``: where the
    per-image augmentations are applied; None: no line for them)."""
    lines = []
    named = [n for n, on in (("TrivialAugmentWide", init_args.get("trivial_augment")),
                             (f"random erasing {init_args.get('random_erasing')}", init_args.get("random_erasing")))
             if on]  # fmt: skip
    if named and decoder is not None:
        batched = "applied on the device after decoding, batched per operation (data.decode gpu)"
        where = batched if decoder == "gpu" else "applied there"
        lines.append(f"augment      {', '.join(named)} per image: drawn in the loader workers (per sample), {where}")
    lines += mixing_lines(init_args)
    repeats = init_args.get("repeated_augmentation") or 1
    if repeats > 1:
        lines.append(
            f"sampler      repeated augmentation x{repeats}: each epoch loads 1/{repeats} of the images {repeats} "
            "times, each copy augmented on its own, the copies on consecutive ranks; its position is saved in "
            "checkpoints (data.repeated_augmentation)"
        )
    crop, resize = init_args.get("eval_image_size"), init_args.get("eval_resize_size")
    if crop or resize:
        size = init_args.get("image_size", 224)
        crop = crop or size
        lines.append(
            f"evaluate     resize {resize or round(crop / 0.875)}, centre crop {crop}; training crops {size} "
            "(data.eval_image_size, data.eval_resize_size)"
        )
    return lines


def mixing_line(mixup_alpha: float, cutmix_alpha: float) -> str:
    """The plan's words for the mixing: what, where and with which draws."""
    which = " or ".join(
        f"{name} {alpha:g}" for name, alpha in (("mixup", mixup_alpha), ("cutmix", cutmix_alpha)) if alpha > 0
    )
    return (
        f"{'mixing':<12} {which} per batch, on the device, each device's share of the batch mixed within itself, drawn "
        "from (seed, epoch, batch, device): the same after a resume"
    )
