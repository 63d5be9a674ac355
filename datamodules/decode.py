"""The one place that turns encoded image bytes into pixels, for the folder and the shard pipelines alike.

``--data.decode`` picks the decoder:

- ``cpu`` (default): JPEGs through TorchCodec's libjpeg-turbo decoder to a uint8 [3, H, W] tensor (the supported
  successor of the deprecated ``torchvision.io.decode_jpeg``, as fast in a loader worker:
  ``bench/results/loader.md``); anything else, and any JPEG that TorchCodec refuses, through PIL.
- ``pil``: PIL for every image (the decoder torchvision's ImageFolder uses), for comparison.
- ``gpu``: the workers only read the bytes and draw the crops; the training process decodes each batch with
  nvImageCodec on its device, then resizes and normalises it there (:mod:`datamodules.gpu_decode`);
- ``auto``: ``gpu`` on CUDA where nvImageCodec and its nvJPEG library load, else ``cpu`` (the plan says which, and why).

Reduced-size decoding: libjpeg can decode a JPEG at 1/2, 1/4 or 1/8 of its size in the DCT domain, much cheaper
than decoding it whole and shrinking it afterwards. TorchCodec has no such option, so those JPEGs go through PIL
(``Image.draft``). Where it applies:

- training (:func:`decode_for` with a transform that starts with ``RandomResizedCrop``): the crop's box is
  drawn first, from the size in the JPEG's header, with the very draws the transform would make on the decoded
  image; the JPEG is then decoded at the largest reduction that keeps that box at least the output size (a box of
  448x448 or more for 224 px: 1/2), and the scaled box is cropped and resized. The same boxes, flips and output size
  as decoding first; an ImageNet-sized photo (~500x375) never has a box twice 224 px, so it is decoded whole, as
  before, pixel for pixel;
- otherwise (evaluation): whenever the shorter side still keeps at least ``min_side`` pixels, the most the transform
  will use (``min_side_for``).
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from PIL import Image
from torchvision.transforms import v2

from core.errors import UserError

Decoder = Literal["auto", "cpu", "pil", "gpu"]
DECODERS = ("auto", "cpu", "pil", "gpu")
JPEG_MAGIC = b"\xff\xd8\xff"
EXIF_ORIENTATION = 0x0112  # the tag TorchCodec applies and PIL does not
RANDOM_CROP_MIN_SCALE = 0.08  # torchvision's RandomResizedCrop default area fraction (and ratio 3/4 .. 4/3)


class UnreadableImageError(UserError, RuntimeError):
    """An image file could not be decoded; the message names it and the option that skips such files."""

    help = "unreadable-image"  # also when a loader worker raised it (torch re-raises it from its message alone)


class _Skipped:
    """What a dataset returns instead of a sample for an unreadable image when skipping is on."""

    def __init__(self, path: str) -> None:
        self.path = path


def min_side_for(image_size: int, train: bool, crop_ratio: float = 0.875) -> int:
    """The shortest source side that still gives the transform full resolution, for reduced-size decoding.

    Evaluation resizes the shorter side to ``image_size / crop_ratio``. Training's RandomResizedCrop may take as
    little as 8 % of the area at aspect ratio 3/4, a square of side ``sqrt(0.08 * 3/4) = 0.245`` of the image's:
    the image must keep ``image_size / 0.245`` pixels so that even that crop is not upscaled.
    """
    if train:
        return math.ceil(image_size / math.sqrt(RANDOM_CROP_MIN_SCALE * 3 / 4))
    return round(image_size / crop_ratio)


def _pil(data: bytes, min_side: int | None) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    if min_side and image.format == "JPEG" and min(image.size) >= 2 * min_side:
        image.draft("RGB", (min_side, min_side))  # DCT scaling: both sides stay >= min_side
    return image.convert("RGB")


def decode(data: bytes, decoder: Decoder = "cpu", min_side: int | None = None) -> torch.Tensor | Image.Image:
    """RGB pixels of an encoded image: a uint8 [3, H, W] tensor (TorchCodec) or a PIL image.

    Raises:
        OSError: no decoder can read the bytes (PIL's UnidentifiedImageError and truncation are OSErrors).
    """
    if decoder != "pil" and data[:3] == JPEG_MAGIC:
        if min_side:
            header = Image.open(io.BytesIO(data))  # lazy: parses the header only
            if min(header.size) >= 2 * min_side:
                return _pil(data, min_side)
        if _torchcodec() is not None:
            try:
                return decode_jpeg_tensor(data)
            except RuntimeError:
                pass  # truncated or unusual JPEGs: PIL decides, with the same error as for every other format
    return _pil(data, min_side)


def decode_crop(data: bytes, crop: v2.RandomResizedCrop, decoder: Decoder = "cpu") -> torch.Tensor | Image.Image:
    """``crop(decode(data, decoder))`` for a JPEG, with the crop's box drawn before decoding, from the header's size,
    so that a box of at least twice the output size is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling)
    instead of whole, then cropped and resized.

    The draws are ``crop``'s own (``make_params`` on the header-only image: the same random numbers in the same
    order as on the decoded image), so the boxes, and the flips drawn after them, are those of decoding first; a box
    decoded whole gives the same pixels. A JPEG with an EXIF orientation, which TorchCodec applies (the decoded size
    is then not the header's), is decoded first, as without this function.
    """
    header = Image.open(io.BytesIO(data))  # lazy: parses the header only
    if header.format != "JPEG" or header.getexif().get(EXIF_ORIENTATION, 1) != 1:
        return crop(decode(data, decoder))
    box = crop.make_params([header])  # top, left, height, width in the full-size image
    out_h, out_w = crop.size
    factor = 1
    while factor < 8 and box["height"] >= 2 * factor * out_h and box["width"] >= 2 * factor * out_w:
        factor *= 2
    if factor == 1:
        image = decode(data, decoder)  # whole, as without this function
    else:
        width, height = header.size
        header.draft("RGB", (width // factor, height // factor))  # exactly 1/factor (PIL picks the largest <= asked)
        image = header.convert("RGB")
        if decoder != "pil":  # a tensor, as TorchCodec gives: torch's uint8 resize is faster than PIL's
            image = v2.functional.pil_to_tensor(image)
        scaled_h, scaled_w = v2.functional.get_size(image)
        sx, sy = scaled_w / width, scaled_h / height
        top, left = min(round(box["top"] * sy), scaled_h - 1), min(round(box["left"] * sx), scaled_w - 1)
        box = {
            "top": top,
            "left": left,
            "height": max(min(round(box["height"] * sy), scaled_h - top), 1),
            "width": max(min(round(box["width"] * sx), scaled_w - left), 1),
        }
    return v2.functional.resized_crop(
        image, **box, size=crop.size, interpolation=crop.interpolation, antialias=crop.antialias
    )


def decode_for(
    data: bytes, transform: Any, decoder: Decoder = "cpu", min_side: int | None = None
) -> tuple[torch.Tensor | Image.Image, Callable[[Any], Any]]:
    """The decoded image and the part of ``transform`` still to apply to it: ``rest(image)`` is
    ``transform(decode(data, decoder, min_side))``, except that a ``v2.Compose`` starting with
    ``RandomResizedCrop`` has its crop done while decoding a JPEG (:func:`decode_crop`)."""
    steps = getattr(transform, "transforms", None)
    if steps and isinstance(steps[0], v2.RandomResizedCrop) and data[:3] == JPEG_MAGIC:
        return decode_crop(data, steps[0], decoder), functools.partial(_apply, steps[1:])
    return decode(data, decoder, min_side), transform


def _apply(steps: list[Callable[[Any], Any]], image: Any) -> Any:
    for step in steps:
        image = step(image)
    return image


@functools.cache
def _torchcodec() -> Callable[..., Any] | None:
    """TorchCodec's ``decode_jpeg``, imported on first use (it loads a native library built for one torch version);
    None, with one warning, where it cannot be loaded: the CPU decoders then use PIL."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError) as err:
        warnings.warn(
            f"TorchCodec cannot be loaded ({type(err).__name__}: {err}): JPEGs are decoded with PIL, about half as "
            "fast per core. Install the torchcodec release built for this torch (constraints.txt pins it).",
            stacklevel=2,
        )
        return None
    return decode_jpeg


def decode_jpeg_tensor(data: bytes) -> torch.Tensor:
    """One JPEG through TorchCodec's libjpeg-turbo decoder; RuntimeError if it refuses the bytes."""
    decode_jpeg = _torchcodec()
    if decode_jpeg is None:
        raise RuntimeError("TorchCodec cannot be loaded")
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode="RGB")


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
