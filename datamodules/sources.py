"""Where a sample's bytes come from, apart from how they become pixels.

A source (the class folders here, the shards of :mod:`datamodules.shards`) only finds a sample's bytes, label and
name; :class:`SampleDecoder` makes the sample of them, the same for every source: pixels after the transform
(``cpu``, ``pil``: :mod:`datamodules.decode`), or the bytes and the transform's draws for the training process to
decode (``gpu``: :mod:`datamodules.gpu_decode`), an unreadable file skipped or stopping the run. :func:`collate`
batches what it makes; the DataModule's device stage (:mod:`datamodules.base`) decodes, normalises and mixes on the
device.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate
from torchvision.datasets import ImageFolder

from core.device import AUTO
from datamodules.decode import Decoder, UnreadableImageError, _Skipped, decode_for, read
from datamodules.gpu_decode import EncodedBatch, draw, gpu_decoding, installed, pip_package

SKIP_HINT = "pass --data.skip_unreadable true to skip unreadable images"
FOLDER_FIX = f"Replace or delete the file, or {SKIP_HINT} (they are counted and reported)."


class SampleDecoder:
    """One sample of a source from its encoded bytes, whatever the source.

    Args:
        transform: the per-image transforms (:func:`datamodules.augment.image_transforms`).
        decoder: ``cpu`` or ``pil`` (decoded here, in the loader worker) or ``gpu`` (the bytes and the transform's
            draws: :func:`datamodules.gpu_decode.draw`).
        min_side: reduced-size decoding threshold (:func:`datamodules.decode.min_side_for`).
        skip_unreadable: an unreadable image becomes a skip mark (:func:`collate` leaves it out and names it)
            instead of stopping the run.
        fix: what the error of an unreadable image tells the user to do.
    """

    def __init__(
        self,
        transform: Any,
        decoder: Decoder = "cpu",
        min_side: int | None = None,
        skip_unreadable: bool = False,
        fix: str = FOLDER_FIX,
    ) -> None:
        self.transform, self.decoder, self.min_side = transform, decoder, min_side
        self.skip_unreadable, self.fix = skip_unreadable, fix

    def __call__(
        self, load: Callable[[], bytes], label: int, name: str, where: Callable[[], str] | None = None
    ) -> tuple[Any, ...] | _Skipped:
        """``(image, label)``, or under ``gpu`` ``(bytes, draws, label, name)``; ``load`` reads the bytes (inside: a
        dangling link or a failing disk is an unreadable image too); ``where`` names the image in messages (default
        ``name``), asked only when it is unreadable."""
        try:
            data = load()
            if self.decoder == "gpu":  # the bytes and the crop's draws: the training process decodes the batch
                return data, draw(data, self.transform), label, name
            image, transform = decode_for(data, self.transform, self.decoder, self.min_side)
        except (OSError, ValueError, SyntaxError) as err:  # PIL's UnidentifiedImageError and truncation are OSErrors
            said = where() if where is not None else name
            if self.skip_unreadable:
                return _Skipped(said)
            raise UnreadableImageError(f"cannot read image {said}: {type(err).__name__}: {err}. {self.fix}") from err
        return transform(image), label


def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor, list[str]] | EncodedBatch:
    """The sources' collate: the readable samples batched (pixels, or under ``gpu`` every image's bytes in one
    buffer, :class:`~datamodules.gpu_decode.EncodedBatch`) and the names of the skipped ones, which the device stage
    strips and counts."""
    kept = [b for b in batch if not isinstance(b, _Skipped)]
    skipped = [b.path for b in batch if isinstance(b, _Skipped)]
    if not kept:
        raise UnreadableImageError(
            f"all {len(batch)} images of a batch are unreadable (e.g. {skipped[0]}): the data set looks broken."
        )
    if isinstance(kept[0][0], bytes):
        return EncodedBatch(kept, skipped)
    images, labels = default_collate(kept)
    return images, labels, skipped


def choose_decoder(decode: str, cuda: bool) -> tuple[Decoder, str]:
    """The decoder ``data.decode`` gives on this device, and why (``auto``'s choice, as the plan says it)."""
    if decode != AUTO:
        return decode, f"data.decode {decode}"  # type: ignore[return-value]
    gpu, why = gpu_decoding(cuda)
    return ("gpu" if gpu else "cpu"), f"data.decode auto: {why}"


def decoder_problem(decoder: Decoder, why: str, cuda: bool) -> str | None:
    """Why ``decoder`` cannot run here (``gpu`` needs nvImageCodec, and on CUDA its nvJPEG), with the fix; None: it
    can. Asked without importing nvImageCodec (:func:`~datamodules.gpu_decode.installed`)."""
    if decoder != "gpu":
        return None
    fix = "or --data.decode cpu (TorchCodec, portable)."
    if installed() is None:
        return f"{why}: nvImageCodec not installed: pip install {pip_package()}; {fix}"
    usable, problem = gpu_decoding(True)  # on CUDA its GPU decoders need nvJPEG; elsewhere its CPU backend
    if cuda and not usable:
        return f"{why}: {problem}; {fix}"
    return None


def decode_line(decoder: Decoder, why: str, cuda: bool) -> str:
    """The plan's line for the decoder: which library decodes, where, and why this one."""
    if decoder == "gpu":
        version = installed() or "(not installed)"
        where = "the training device" if cuda else "the CPU (its CPU backend)"
        reads = "the loader workers read bytes, draw the crops"
        return f"decode       gpu: nvImageCodec {version} on {where}; {reads} ({why})"
    engine = _torchcodec_version() if decoder == "cpu" else "PIL"
    return f"decode       {decoder}: {engine} in the loader workers ({why})"


def _torchcodec_version() -> str:
    try:
        return f"TorchCodec {importlib.metadata.version('torchcodec')}"
    except importlib.metadata.PackageNotFoundError:
        return "PIL (TorchCodec not installed)"


class ImageFolderChecked(ImageFolder):
    """The class-folder source: an ``ImageFolder`` whose samples :class:`SampleDecoder` makes (an unreadable image
    stops the run naming the file, or is skipped when asked)."""

    def __init__(
        self,
        root: str | Path,
        transform: Any,
        skip_unreadable: bool = False,
        decoder: Decoder = "cpu",
        min_side: int | None = None,
    ) -> None:
        super().__init__(str(root), transform=transform)
        self.sample = SampleDecoder(transform, decoder, min_side, skip_unreadable)

    def __getitem__(self, index: int) -> tuple[Any, ...] | _Skipped:
        path, target = self.samples[index]
        return self.sample(functools.partial(read, path), target, path)


class SyntheticImages(Dataset):
    """``length`` random images of the final shape with random labels, for benchmarks without data.

    Samples come from a small bank of uint8 images generated once and are normalised on the device after the
    transfer, so producing, collating and copying a sample costs next to nothing: the input pipeline is taken out
    of the measurement.
    """

    def __init__(self, length: int, num_classes: int, image_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (64, 3, image_size, image_size), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.labels[index]
