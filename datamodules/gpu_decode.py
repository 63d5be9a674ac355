"""``--data.decode gpu``: the training process decodes each batch with nvImageCodec on its own device.

The loader workers only read each image's encoded bytes and draw its crop box and flip, with the very draws of the
CPU path (:func:`draw`: ``RandomResizedCrop.make_params`` on the header's size, then the flip's ``torch.rand(1)``,
from the generators :class:`~datamodules.resumable.SeededDataset` seeds per sample), so boxes, flips, sample order
and a mid-epoch resume are those of ``--data.decode cpu``. What crosses from a worker is the batch's bytes in one
buffer (~50 KB per ImageNet photo instead of 600 KB of float pixels). The training process then (:class:`BatchDecoder`):

1. decodes the whole batch in one nvImageCodec call, each image only within its box (region-of-interest decoding),
   on a side CUDA stream that overlaps the step in flight (:func:`on_side_stream`): on a GPU with its hardware JPEG
   decoder (A100, H100, H200; ``decode gpu`` takes nvJPEG's CUDA backend where there is none, ``auto`` the CPU), on
   a CPU device its CPU backend (the same code, which the CI runs);
2. decodes on the CPU (TorchCodec, then PIL) the few images nvImageCodec refuses (a GIF named .jpg, a format it
   lacks, a JPEG cut short, a corrupt file, found by halving a batch the hardware fails whole), one by one, counted
   (``fallbacks``); if nothing can decode at the first batch, everything from then on (the first-run guard);
3. resizes every box to the output size, flips, applies the drawn augmentations batched per operation
   (:mod:`datamodules.gpu_augment`) and normalises the whole batch at once (:func:`resize_batch`) and returns it
   channels-last in the precision's input dtype.

Why :func:`resize_batch` is written here: the boxes differ in size, and torch's ``interpolate`` takes one size per
call (a loop over 256 images is 256+ kernel launches per batch, the cost this path removes); nvImageCodec decodes but
does not resize. A separable antialiased bilinear resize is two matrix products per image, batched: the weights are
those of torch's own ``antialias=True`` kernel (PIL's triangle filter), so the result equals ``resized_crop`` within
float rounding (``tests/unit/test_gpu_decode.py``).

nvImageCodec is found without importing it (:func:`installed`): its import loads nvJPEG, whose handle lands on the
current device, so it is imported at the first batch, once Lightning has set the rank's device. It prints load errors
for the nvJPEG2000 and nvTIFF libraries it finds missing, and logs every image it cannot decode: :func:`nvimgcodec`
imports it with its log off and that output kept.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import io
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from core.env import set_default
from datamodules.augment import MEAN, MEAN_LEVELS, STD, erase_batch, erasing_draw, trivial_augment_draw
from datamodules.decode import EXIF_ORIENTATION, UnreadableImageError, decode
from datamodules.gpu_augment import BatchAugment

# one image's geometry as the workers draw it (:func:`draw`): the region to decode in the (oriented) image, the flip,
# whether the region is decoded alone (1) or cut from the whole image (0: an EXIF orientation the decoder applies
# first), per axis the source pixels per output pixel and the first output pixel's offset in source pixels, the
# output side, TrivialAugmentWide's operation (-1: none) and magnitude, and the random erasing's box (height 0: none)
GEOMETRY = (
    "top", "left", "height", "width", "flip", "roi", "scale_y", "shift_y", "scale_x", "shift_x", "size",
    "augment_op", "augment_magnitude", "erase_top", "erase_left", "erase_height", "erase_width",
)  # fmt: skip
TOP, LEFT, HEIGHT, WIDTH, FLIP, ROI, SCALE_Y, SHIFT_Y, SCALE_X, SHIFT_X, SIZE, AUGMENT_OP, AUGMENT_MAGNITUDE = range(13)
ERASE = slice(13, 17)
CHUNK = 32  # images resized at once, at most
PIXELS = CHUNK * 500 * 500  # padded pixels resized at once, at most: the half copy of a chunk is <= 48 MB (one box
# alone may be larger: a 4000 x 3000 photo whose crop covers most of it)


@contextlib.contextmanager
def _captured_stderr() -> Iterator[io.StringIO]:
    """What native code writes to file descriptor 2 meanwhile (``fprintf(stderr, ...)`` is not ``sys.stderr``)."""
    said = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said.write(sink.read().decode(errors="replace"))


@functools.cache
def nvimgcodec() -> tuple[Any, str]:
    """nvImageCodec's module, imported once and quietly, and what it said while loading; (None, why) when it cannot
    be imported. Its log level (``PYNVIMGCODEC_VERBOSITY``) is 0 unless the user set one."""
    set_default("PYNVIMGCODEC_VERBOSITY", "0")
    with _captured_stderr() as said:
        try:
            from nvidia import nvimgcodec as module
        except (ImportError, OSError) as err:
            module = None
            said.write(f"{type(err).__name__}: {err}")
    return module, said.getvalue()


def pip_package() -> str:
    major = (torch.version.cuda or "13").split(".")[0]
    return f"nvidia-nvimgcodec-cu{major}[nvjpeg]"


def installed() -> str | None:
    """nvImageCodec's version when it is installed, found without importing it: its import loads nvJPEG, which makes
    a handle on the current device, so under one-node DDP a rank that imports it before Lightning has set the rank's
    device leaves a context on GPU 0. It is imported on the first encoded batch, in the device stage."""
    try:
        if importlib.util.find_spec("nvidia.nvimgcodec") is None:
            return None
    except (ImportError, ValueError):  # no "nvidia" package at all
        return None
    for name in ("nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "(version unknown)"


def nvjpeg_found() -> bool:
    """Whether a libnvjpeg is there for nvImageCodec's GPU decoders to load: in the ``nvidia`` wheels
    (``nvidia/cu13/lib``, ``nvidia/nvjpeg/lib``) or where the dynamic loader looks; the file only, nothing loaded."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if any(any(Path(root).glob("*/lib/libnvjpeg.so*")) for root in roots):
        return True
    return ctypes.util.find_library("nvjpeg") is not None


def gpu_decoding(cuda: bool) -> tuple[bool, str]:
    """Whether ``--data.decode auto`` may decode on the GPU, and why, without importing nvImageCodec: on CUDA, with it
    and nvJPEG installed. Whether the GPU has a JPEG engine is only known once a hardware decoder is made on the rank's
    device: at the first batch (:class:`BatchDecoder`), which decodes on the CPU when it has none."""
    if not cuda:
        return False, "the run is not on CUDA"
    version = installed()
    if version is None:
        return False, f"nvImageCodec not installed: pip install {pip_package()}"
    if not nvjpeg_found():
        return False, f"nvImageCodec {version} found no nvJPEG library: pip install {pip_package()}"
    return True, "nvJPEG found; GPU decoding if the JPEG engine answers at the first batch, else CPU decoding"


# ------------------------------------------------------------------------------------------------ the workers
def _size_for_draws(header: Image.Image) -> tuple[Any, bool]:
    """What the CPU path draws the crop from (its size is all ``make_params`` reads), and whether the decoder applies
    an EXIF orientation first: TorchCodec and nvImageCodec do for a JPEG, so the box is drawn on the oriented size."""
    orientation = header.getexif().get(EXIF_ORIENTATION, 1) if header.format == "JPEG" else 1
    if orientation == 1:
        return header, True
    width, height = header.size
    if orientation >= 5:  # a quarter turn: the decoded image is height x width
        width, height = height, width
    return torch.empty(1, 1, 1, dtype=torch.uint8).expand(3, height, width), False


def draw(data: bytes, transform: v2.Compose) -> tuple[float, ...]:
    """One image's geometry, drawn in a loader worker exactly as the CPU path draws it: the region to decode (top,
    left, height, width), the flip, whether that region is decoded alone, the resize from it (per axis: source pixels
    per output pixel and the offset of the first output pixel), the output side, and the per-image augmentations, as
    :data:`GEOMETRY` lists them.

    Training (``RandomResizedCrop`` then ``RandomHorizontalFlip``): the box is the crop's own ``make_params`` on the
    image's size, the flip the flip's own ``torch.rand(1) < p``, in that order, as ``decode_crop`` and the transform
    draw them; the box is resized to the output size. Then, if the transform has them, TrivialAugmentWide's operation
    and magnitude and random erasing's box, with their own draws in the transform's order
    (:mod:`datamodules.augment`). Evaluation (``Resize`` then ``CenterCrop``): the whole image, and the rows and
    columns of its resize that the centre crop keeps.

    Raises:
        OSError: the header cannot be read (the CPU path's error for an unreadable file).
    """
    header = Image.open(io.BytesIO(data))  # lazy: parses the header only
    stand_in, roi = _size_for_draws(header)
    height, width = v2.functional.get_size(stand_in) if isinstance(stand_in, torch.Tensor) else header.size[::-1]
    steps = transform.transforms
    if isinstance(steps[0], v2.RandomResizedCrop):
        box = steps[0].make_params([stand_in])
        flip = len(steps) > 1 and isinstance(steps[1], v2.RandomHorizontalFlip) and bool(torch.rand(1) < steps[1].p)
        out_h, out_w = steps[0].size
        top, left, box_h, box_w = box["top"], box["left"], box["height"], box["width"]
        augment, erase = (-1, 0.0), (0, 0, 0, 0)
        for step in steps[2:]:
            if isinstance(step, v2.TrivialAugmentWide):
                augment = trivial_augment_draw(step)
            elif isinstance(step, v2.RandomErasing):
                erase = erasing_draw(step, (out_h, out_w))
        geometry = (top, left, box_h, box_w, int(flip), int(roi), box_h / out_h, 0.0, box_w / out_w, 0.0, out_h)
        return (*geometry, *augment, *erase)
    if isinstance(steps[0], v2.Resize) and isinstance(steps[1], v2.CenterCrop):
        # v2.Resize(short): the shorter side to `short`, the longer scaled and truncated; v2.CenterCrop: its offset
        # rounded. Output pixel i is pixel i + offset of that resize: the same filter windows, cut afterwards.
        short = steps[0].size if isinstance(steps[0].size, int) else steps[0].size[0]
        if width <= height:
            resized_h, resized_w = int(short * height / width), short
        else:
            resized_h, resized_w = short, int(short * width / height)
        crop_h, crop_w = steps[1].size
        top, left = int(round((resized_h - crop_h) / 2.0)), int(round((resized_w - crop_w) / 2.0))
        scale_y, scale_x = height / resized_h, width / resized_w
        return 0, 0, height, width, 0, 0, scale_y, top * scale_y, scale_x, left * scale_x, crop_h, -1, 0.0, 0, 0, 0, 0
    raise ValueError(f"data.decode gpu draws RandomResizedCrop + flip or Resize + CenterCrop only, not {transform}")


class EncodedBatch:
    """A batch as the workers hand it over: every image's bytes in one buffer (one shared-memory segment), their
    offsets, geometries (:func:`draw`) and labels, their file names (for messages) and the unreadable ones skipped.

    A plain class, neither tuple nor dataclass: Lightning's collection helpers leave it as it is (they would copy a
    dataclass field by field) until the device stage (:meth:`ImageDataModule.on_before_batch_transfer`) decodes it."""

    __slots__ = ("data", "offsets", "geometry", "labels", "names", "skipped")

    def __init__(self, samples: list[tuple[bytes, tuple, int, str]], skipped: list[str]) -> None:
        # one copy of the bytes (a bytearray is writable: the tensor shares it instead of copying it again)
        self.data = torch.frombuffer(bytearray().join(s[0] for s in samples), dtype=torch.uint8)
        self.offsets = torch.tensor([0, *np.cumsum([len(s[0]) for s in samples]).tolist()], dtype=torch.int64)
        self.geometry = torch.tensor([s[1] for s in samples], dtype=torch.float64).reshape(-1, len(GEOMETRY))
        self.labels = torch.tensor([s[2] for s in samples], dtype=torch.int64)
        self.names, self.skipped = [s[3] for s in samples], skipped

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory thread calls this (pin_memory=True on CUDA)
        self.data, self.geometry, self.labels = (t.pin_memory() for t in (self.data, self.geometry, self.labels))
        return self

    def image(self, index: int) -> np.ndarray:
        return self.data[self.offsets[index] : self.offsets[index + 1]].numpy()


# ------------------------------------------------------------------------------------------------ the training process
def _weights(
    lengths: torch.Tensor, size: int, pad: int, scale: torch.Tensor, shift: torch.Tensor, flips: torch.Tensor | None
) -> torch.Tensor:
    """[N, size, pad]: how output pixel ``i`` of image ``n`` weighs its ``lengths[n]`` source pixels, as torch's
    antialiased bilinear resize does (``_upsample_bilinear2d_aa``: a triangle filter centred on source position
    ``scale * (i + 0.5) + shift``, as wide as ``scale`` when shrinking, normalised per output pixel); the rows reversed
    for a flipped image."""
    device = lengths.device
    scale, shift = scale.float(), shift.float()
    support = scale.clamp(min=1.0)
    centre = (torch.arange(size, device=device, dtype=torch.float32) + 0.5)[None, :] * scale[:, None] + shift[:, None]
    source = torch.arange(pad, device=device, dtype=torch.float32) + 0.5
    weights = (1 - (source[None, None, :] - centre[:, :, None]).abs() / support[:, None, None]).clamp(min=0)
    weights = weights * (source[None, None, :] < lengths[:, None, None])  # the padding weighs nothing
    weights = weights / weights.sum(-1, keepdim=True)
    if flips is not None:
        weights = torch.where(flips.bool()[:, None, None], weights.flip(1), weights)
    return weights


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting: a copy from pageable memory to a GPU waits for the GPU's
    queue to drain (the step in flight), one from pinned memory does not."""
    if device.type != "cuda" or tensor.device == device:
        return tensor
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def resize_batch(boxes: list[torch.Tensor], size: int, geometry: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """The boxes (uint8 [h, w, 3], any sizes, on one device) resized as their rows of ``geometry`` say (scale, shift,
    flip) to ``size`` x ``size``: float [N, size, size, 3] (NHWC), values 0..255, computed in ``compute``."""
    device = boxes[0].device
    heights = to_device(torch.tensor([b.shape[0] for b in boxes]), device)
    widths = to_device(torch.tensor([b.shape[1] for b in boxes]), device)
    pad_h, pad_w = int(max(b.shape[0] for b in boxes)), int(max(b.shape[1] for b in boxes))
    padded = torch.zeros(len(boxes), pad_h, pad_w, 3, dtype=torch.uint8, device=device)
    for index, box in enumerate(boxes):
        padded[index, : box.shape[0], : box.shape[1]] = box
    g = to_device(geometry, device)
    rows = _weights(heights, size, pad_h, g[:, SCALE_Y], g[:, SHIFT_Y], None).to(compute)
    cols = _weights(widths, size, pad_w, g[:, SCALE_X], g[:, SHIFT_X], g[:, FLIP]).to(compute)
    tall = torch.bmm(rows, padded.to(compute).view(len(boxes), pad_h, pad_w * 3))  # [N, size, pad_w * 3]
    return torch.einsum("ntw,nswc->nstc", cols, tall.view(len(boxes), size, pad_w, 3))


JPEG = b"\xff\xd8"  # a JPEG's start-of-image marker
NO_ENGINE = "this GPU has no JPEG engine (T4/A10/L40S class)"


def open_decoder(module: Any, device: torch.device, threads: int, hardware: bool) -> Any:
    """nvImageCodec's decoder on ``device`` with at most ``threads`` CPU threads (0 would start one per core in every
    rank): on CUDA its hardware JPEG decoder only (``hardware``: raises where the GPU has none, as a Decoder of no
    backend that can run cannot be made) or every backend; on a CPU device its CPU backend."""
    if device.type != "cuda":
        cpu = [module.Backend(module.BackendKind.CPU_ONLY)]
        return module.Decoder(device_id=module.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=threads, backends=cpu)
    backends = [module.Backend(module.BackendKind.HW_GPU_ONLY)] if hardware else None
    return module.Decoder(device_id=device.index or 0, max_num_cpu_threads=threads, backends=backends)


def truncated(data: np.ndarray) -> bool:
    """A JPEG whose stream does not end with its end-of-image marker (trailing zeros aside): nvJPEG may decode it
    half and report success, so it goes to the CPU path, which reads it whole or calls it unreadable."""
    if data[:2].tobytes() != JPEG:
        return False
    end = np.flatnonzero(data[-64:])
    return end.size == 0 or data[-64:][: end[-1] + 1][-2:].tobytes() != b"\xff\xd9"


class BatchDecoder:
    """Decodes :class:`EncodedBatch` es on ``device`` with nvImageCodec, then resizes, flips and normalises them.

    nvImageCodec is imported, and its decoder made, at the first batch (the rank's device is set by then). On CUDA a
    batch goes to the GPU's hardware JPEG decoder alone; where it fails a whole batch, the batch is decoded again in
    halves until the files it refuses are found, and those (as every file nvImageCodec refuses) are decoded on the CPU,
    one by one, counted (``fallbacks``). If no decoder can be made at the first batch (``auto``: no hardware one), or
    nvImageCodec decodes none of its images, the run says so once and decodes on the CPU (TorchCodec, else PIL, in
    ``threads`` threads of the training process) from then on; that batch included.

    Args:
        device: the training device: CUDA (nvImageCodec's GPU decoders) or CPU (its CPU backend).
        skip_unreadable: an image no decoder reads is left out of its batch (named in ``skipped``) instead of
            stopping the run.
        threads: CPU threads the decoding may use in this process (the rank's cores less its loader workers).
        hardware_only: ``auto``: decode on the GPU only with its hardware JPEG decoder (else on the CPU); otherwise
            with every backend when the hardware one cannot be made.
        opener: makes the decoder (default :func:`open_decoder`): ``(module, device, threads, hardware) -> decoder``.
    """

    def __init__(
        self,
        device: torch.device,
        skip_unreadable: bool = False,
        threads: int = 1,
        hardware_only: bool = False,
        opener: Callable[[Any, torch.device, int, bool], Any] = open_decoder,
    ) -> None:
        self.device, self.skip_unreadable, self.threads = device, skip_unreadable, max(threads, 1)
        self.hardware_only, self.opener = hardware_only, opener
        self.nv: Any = None
        self.decoder: Any = None  # None before the first batch, and after GPU decoding gave up (then self.said)
        self.said: str | None = None  # the one line saying why decoding went to the CPU
        self.fallbacks: list[str] = []  # images nvImageCodec refused and the CPU decoded
        self.skipped: list[str] = []  # images no decoder could read (skip_unreadable)
        self.batches = 0
        mean = torch.tensor(MEAN, dtype=torch.float32, device=device) * 255
        self.mean, self.std = mean, torch.tensor(STD, dtype=torch.float32, device=device) * 255
        self.augment = BatchAugment(device)  # the workers drew its operations (draw); they are applied here
        self.erase_value = torch.tensor(MEAN_LEVELS, dtype=torch.float32, device=device)

    def _open(self) -> None:
        """nvImageCodec and its decoder, at the first batch; where that fails, CPU decoding from now on, said once."""
        module, said = nvimgcodec()
        if module is None:
            return self._give_up(f"nvImageCodec cannot be imported ({said.strip()[:200]})")
        self.nv = module
        self.params = module.DecodeParams(color_spec=module.SRGB, apply_exif_orientation=True)
        try:
            self.decoder = self.opener(module, self.device, self.threads, True)
        except RuntimeError as err:
            if self.hardware_only:
                return self._give_up(f"decode cpu: {NO_ENGINE}: no hardware decoder ({err})")
            try:  # decode gpu: nvJPEG's CUDA backend where the GPU has no JPEG engine
                self.decoder = self.opener(module, self.device, self.threads, False)
            except RuntimeError as again:
                return self._give_up(f"GPU decoding failed at its first batch: no decoder ({again})")
        return None

    def _give_up(self, why: str) -> None:
        self.decoder, self.said = None, f"{why}; continuing with CPU decoding in the training process"
        warnings.warn(f"{self.said} (--data.decode cpu decodes in the loader workers, faster)", stacklevel=3)

    def _stream(self, image: np.ndarray, geometry: list[int]) -> Any:
        stream = self.nv.CodeStream(image)
        if not geometry[ROI]:
            return stream
        top, left = geometry[TOP], geometry[LEFT]
        region = self.nv.Region(top, left, top + geometry[HEIGHT], left + geometry[WIDTH])
        return stream.get_sub_code_stream(region=region)

    def _streams(self, images: list[np.ndarray], geometry: list[list[int]]) -> list[Any]:
        """Each image's code stream; None where the CPU path decodes it (nvImageCodec cannot parse it: a format it
        lacks; a JPEG cut short: :func:`truncated`)."""
        streams: list[Any] = []
        for image, where in zip(images, geometry, strict=True):
            try:
                streams.append(None if truncated(image) else self._stream(image, where))
            except RuntimeError:
                streams.append(None)
        return streams

    def _decode_set(self, streams: list[Any], indices: list[int], raises: bool = False) -> dict[int, Any]:
        """nvImageCodec's images for ``indices`` (None: refused). A call that fails as a whole (it raises, or every
        image is None: nvJPEG's hardware backend fails its whole batch for one corrupt file) is made again in halves,
        so a bad file costs only itself; ``raises``: an error of this call is raised instead (the first batch's)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        try:
            got = self.decoder.decode([streams[i] for i in indices], params=self.params, cuda_stream=stream)
        except RuntimeError:
            if raises:
                raise
            got = [None] * len(indices)
        if len(indices) > 1 and all(g is None for g in got):
            mid = len(indices) // 2
            return {**self._decode_set(streams, indices[:mid]), **self._decode_set(streams, indices[mid:])}
        return dict(zip(indices, got, strict=True))

    def _decode_all(self, images: list[np.ndarray], geometry: list[list[int]]) -> list[Any]:
        """nvImageCodec's image per position (None: the CPU decodes it); the first-batch guard."""
        first = self.batches == 0
        self.batches += 1
        if first:
            self._open()
        if self.decoder is None:
            return [None] * len(images)
        streams = self._streams(images, geometry)
        parsed = [i for i, s in enumerate(streams) if s is not None]
        try:
            got = self._decode_set(streams, parsed, raises=first) if parsed else {}
        except RuntimeError as err:  # the first batch: the backend fails as a whole
            self._give_up(f"GPU decoding failed at its first batch ({type(err).__name__}: {str(err)[:200]})")
            return [None] * len(images)
        jpegs = [i for i in parsed if images[i][:2].tobytes() == JPEG]  # what the hardware decoder takes
        if first and jpegs and all(got[i] is None for i in jpegs):  # even alone, after the halving: not a bad file
            self._give_up(
                f"GPU decoding failed at its first batch (nvImageCodec decoded none of its {len(jpegs)} JPEGs)"
            )
            return [None] * len(images)
        return [got.get(i) for i in range(len(images))]

    def _tensor(self, decoded: Any, where: list[int]) -> torch.Tensor:
        if decoded.buffer_kind == self.nv.ImageBufferKind.STRIDED_HOST:
            box = torch.from_numpy(np.asarray(decoded)).to(self.device)
        else:
            box = torch.from_dlpack(decoded)
        if not where[ROI]:  # decoded whole (an EXIF orientation applied): the box is cut here
            box = box[where[TOP] : where[TOP] + where[HEIGHT], where[LEFT] : where[LEFT] + where[WIDTH]]
        return box

    def _on_the_cpu(self, data: np.ndarray, geometry: list[int]) -> torch.Tensor | Exception:
        """One image decoded as the CPU path does (TorchCodec, else PIL), cropped to its box; the error if it cannot
        be read (raised by the caller, in order)."""
        try:
            pixels = decode(data.tobytes(), "cpu")
        except (OSError, ValueError, SyntaxError) as err:
            return err
        if isinstance(pixels, Image.Image):
            pixels = v2.functional.pil_to_tensor(pixels)
        top, left = geometry[TOP], geometry[LEFT]
        box = pixels[:, top : top + geometry[HEIGHT], left : left + geometry[WIDTH]].permute(1, 2, 0)
        return to_device(box.contiguous(), self.device)

    def decode(self, batch: EncodedBatch) -> tuple[list[torch.Tensor], list[int]]:
        """Every image's box as uint8 [h, w, 3] on the device, and the positions kept (an unreadable image skipped)."""
        geometry = [[int(v) for v in row[: ROI + 1]] for row in batch.geometry.tolist()]
        images = [batch.image(i) for i in range(len(batch))]
        decoded = self._decode_all(images, geometry)
        refused = [i for i, out in enumerate(decoded) if out is None]
        on_cpu: dict[int, torch.Tensor | Exception] = {}
        if refused:
            with ThreadPoolExecutor(min(self.threads, len(refused))) as pool:  # PIL and TorchCodec free the GIL
                done = pool.map(self._on_the_cpu, [images[i] for i in refused], [geometry[i] for i in refused])
                on_cpu = dict(zip(refused, done, strict=True))
        boxes, kept = [], []
        for index, out in enumerate(decoded):
            box = self._tensor(out, geometry[index]) if out is not None else on_cpu[index]
            if isinstance(box, Exception):
                self._unreadable(batch.names[index], box)
                continue
            if out is None and self.decoder is not None:
                self._fell_back(batch.names[index])
            boxes.append(box.expand(-1, -1, 3) if box.shape[-1] == 1 else box[..., :3])
            kept.append(index)
        return boxes, kept

    def _unreadable(self, name: str, err: Exception) -> None:
        if not self.skip_unreadable:
            raise UnreadableImageError(
                f"cannot read image {name}: {type(err).__name__}: {err}. Replace or delete the file, or pass "
                "--data.skip_unreadable true to skip unreadable images (they are counted and reported)."
            ) from err
        self.skipped.append(name)

    def _fell_back(self, name: str) -> None:
        if not self.fallbacks:  # said when it first happens; the count at the end of the stage
            warnings.warn(
                f"nvImageCodec could not decode {name}: it was decoded on the CPU (slower); each such image is "
                "counted and the count said at the end of the stage",
                stacklevel=3,
            )
        self.fallbacks.append(name)

    def __call__(self, batch: EncodedBatch, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch decoded, resized, flipped and normalised on the device: images [N, 3, size, size] in ``dtype``,
        channels-last in memory, and their labels."""
        boxes, kept = self.decode(batch)
        if not boxes:
            raise UnreadableImageError(f"all {len(batch)} images of a batch are unreadable (e.g. {batch.names[0]})")
        geometry = batch.geometry[kept]
        size = int(geometry[0, SIZE])  # the training crop or the evaluation crop: one per batch
        compute = torch.float16 if self.device.type == "cuda" else torch.float32
        pixels = torch.empty(len(boxes), size, size, 3, dtype=torch.float32, device=self.device)
        on_device = to_device(geometry, self.device)  # one copy of the batch's draws: every operation reads them
        for chunk in chunks([box.shape[:2] for box in boxes]):
            where = to_device(torch.tensor(chunk), self.device)
            pixels[where] = resize_batch([boxes[i] for i in chunk], size, on_device[where], compute).float()
        pixels = self._augment(pixels, on_device)
        labels = batch.labels[kept] if len(kept) < len(batch) else batch.labels
        images = ((pixels - self.mean) / self.std).permute(0, 3, 1, 2)
        return images.to(dtype, memory_format=torch.channels_last), labels

    def _augment(self, pixels: torch.Tensor, geometry: torch.Tensor) -> torch.Tensor:
        """TrivialAugmentWide and random erasing as the workers drew them (:func:`draw`), on the batch's float
        [N, s, s, 3] images in pixel levels: each operation once for the batch (:class:`BatchAugment`), the erasing
        one masked write. ``geometry`` is on the device: nothing is read back, no tensor built per image."""
        pixels = self.augment(pixels, geometry[:, AUGMENT_OP], geometry[:, AUGMENT_MAGNITUDE])
        return erase_batch(pixels, geometry[:, ERASE].to(torch.int64), self.erase_value)


def chunks(sizes: list[tuple[int, int]]) -> Iterator[list[int]]:
    """Indices of boxes of similar size (sorted by area) resized together: each chunk is padded to its largest height
    and width, so it holds at most :data:`CHUNK` boxes and :data:`PIXELS` padded pixels (a larger box alone)."""
    chunk: list[int] = []
    height = width = 0
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i][0] * sizes[i][1]):
        h, w = max(height, sizes[i][0]), max(width, sizes[i][1])
        if chunk and (len(chunk) == CHUNK or (len(chunk) + 1) * h * w > PIXELS):
            yield chunk
            chunk, h, w = [], sizes[i][0], sizes[i][1]
        chunk.append(i)
        height, width = h, w
    if chunk:
        yield chunk


def on_side_stream(work: Callable[[], tuple[Any, ...]], side: Any, main: Any, streams: Any) -> tuple[Any, ...]:
    """``work()`` run on the ``side`` stream, its results handed to ``main`` (``streams``: ``torch.cuda``).

    Decoding a batch on a stream of its own lets its kernels (and nvImageCodec's, which run on the stream current when
    it is called) overlap the step still queued on the training stream; ``main`` then waits for them before the step
    reads the batch, and each device tensor returned is recorded on ``main``, so that the caching allocator does not
    hand its memory to the side stream again before the step has used it (``Tensor.record_stream``)."""
    with streams.stream(side):
        out = work()
    main.wait_stream(side)
    for tensor in out:
        if tensor.is_cuda:
            tensor.record_stream(main)
    return out


def input_dtype(precision: str) -> torch.dtype:
    """The dtype a batch is handed to the step in: the half type the precision computes in (mixed or true), float64
    for 64-true, else float32."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("64"):
        return torch.float64
    return torch.float16 if precision.startswith("16") else torch.float32
