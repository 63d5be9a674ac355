"""``--data.decode gpu`` on the CPU (nvImageCodec's CPU backend runs the same code as on a GPU): the same crops,
flips, labels and sample order as the CPU path on every rank, the same TrivialAugment operations and erasing boxes,
bad files decoded on the CPU one by one, ``auto``'s choice and its reason, and the batched resize against torch's
own."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from datamodules.augment import STD
from datamodules.decode import UnreadableImageError
from datamodules.gpu_decode import (
    AUGMENT_OP,
    CHUNK,
    ERASE,
    FLIP,
    GEOMETRY,
    PIXELS,
    BatchDecoder,
    EncodedBatch,
    chunks,
    on_side_stream,
    open_decoder,
    resize_batch,
    truncated,
)
from datamodules.imagenet import ImageNetDataModule
from datamodules.sources import choose_decoder, decoder_problem
from modules.classifier import ImageClassifier
from tests.conftest import ROOT
from tests.unit.test_imagenet import photos  # noqa: F401  (the real-photo ImageFolder fixture)

SIZE = 112  # photos of at most 192 px: no crop is twice this, so the CPU path decodes every JPEG whole too
LEVELS = 255 * min(STD)  # one normalised unit in pixel levels (at least)


def _batches(data_dir: Path, decode: str, rank: int, monkeypatch, workers: int, **kwargs) -> list:
    """Every training and validation batch of ``rank`` (of 2, as a 2-process ddp job's rank sees them)."""
    monkeypatch.setenv("LOCAL_RANK", str(rank))  # Lightning's environment: which local process this is
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    dm = ImageNetDataModule(str(data_dir), batch_size=3, num_workers=workers, image_size=SIZE, decode=decode, **kwargs)
    dm.trainer = trainer
    dm.setup("fit")
    assert dm.decoder == decode and trainer.distributed_sampler_kwargs == {"num_replicas": 2, "rank": rank}
    out = []
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for batch in loader:
            if decode == "gpu":
                assert isinstance(batch, EncodedBatch) and batch.data.dtype == torch.uint8  # bytes, not pixels
                out.append(batch.geometry)
            images, labels, *_ = dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0)
            out.append((images, labels))
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_gpu_path_gives_each_rank_the_cpu_paths_crops_flips_labels_and_order(photos, monkeypatch, rank):  # noqa: F811
    cpu = _batches(photos, "cpu", rank, monkeypatch, workers=0)
    # in the training process here; through loader workers: tests/distributed/test_resume_anywhere.py's ImageNet run
    gpu = _batches(photos, "gpu", rank, monkeypatch, workers=0)
    geometry = torch.cat([g for g in gpu if isinstance(g, torch.Tensor)])
    gpu = [g for g in gpu if not isinstance(g, torch.Tensor)]
    assert len(cpu) == len(gpu) == 3 + 2  # 9 training images per rank (3 batches), 5 and 4 validation images
    for (x_cpu, y_cpu), (x_gpu, y_gpu) in zip(cpu, gpu, strict=True):
        assert torch.equal(y_cpu, y_gpu)  # the same samples in the same order
        assert x_gpu.shape == x_cpu.shape and x_gpu.is_contiguous(memory_format=torch.channels_last)
        # the same box and flip, decoded by another JPEG decoder and resized in float: within one pixel level
        difference = (x_gpu - x_cpu).abs() * 255 * max(STD)
        assert difference.max() < 1.5 and difference.mean() < 0.5, (difference.max(), difference.mean())
    # not vacuous: crops and flips were drawn (a crop from the wrong box, or unflipped, differs by tens of levels)
    train = geometry[: 3 * 3]
    assert 0 < int(train[:, FLIP].sum()) < len(train) and bool((train[:, GEOMETRY.index("top")] > 0).any())
    unflipped = torch.flip(gpu[0][0], dims=[3])
    assert ((unflipped - cpu[0][0]).abs() * LEVELS).mean() > 10


def test_gpu_path_applies_the_cpu_paths_trivial_augment_and_random_erasing(photos, monkeypatch):  # noqa: F811
    """The modern recipe's per-image augmentations: the workers draw each image's TrivialAugment operation and
    magnitude and its erasing box as the CPU path draws them; the training process applies them on the device. Both
    paths give the same images but where an operation turns a one-level difference of the decoders into more
    (posterize, solarize at their thresholds, a rotation's interpolation): a few pixels in a thousand."""
    kwargs = {"trivial_augment": True, "random_erasing": 0.5, "normalize_on_device": True}
    cpu = _batches(photos, "cpu", 0, monkeypatch, workers=0, **kwargs)
    gpu = _batches(photos, "gpu", 0, monkeypatch, workers=1, **kwargs)
    geometry = torch.cat([g for g in gpu if isinstance(g, torch.Tensor)])[: 3 * 3]  # the training images
    gpu = [g for g in gpu if not isinstance(g, torch.Tensor)]
    assert len({int(op) for op in geometry[:, AUGMENT_OP]}) >= 4 and 0 < int((geometry[:, ERASE][:, 2] > 0).sum()) < 9
    for (x_cpu, y_cpu), (x_gpu, y_gpu) in zip(cpu, gpu, strict=True):
        assert torch.equal(y_cpu, y_gpu)
        difference = (x_gpu - x_cpu).abs() * 255 * max(STD)
        assert difference.mean() < 0.5 and (difference > 3).float().mean() < 1e-2, difference.mean()
    unaugmented = _batches(photos, "cpu", 0, monkeypatch, workers=0, normalize_on_device=True)
    assert ((unaugmented[0][0] - cpu[0][0]).abs() * LEVELS).mean() > 10  # not vacuous: the augmentations show


def _image_bytes(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def with_bad_files(photos, tmp_path_factory) -> Path:  # noqa: F811
    """The photos, plus in one class: a GIF named .jpg (nvImageCodec cannot read GIFs), a PNG named .jpg, and a
    truncated JPEG (no decoder reads it)."""
    root = tmp_path_factory.mktemp("bad") / "imagenet"
    shutil.copytree(photos, root)
    cat = Image.open(root / "train" / "cat" / "chelsea.jpg").convert("RGB")
    for split in ("train", "val"):
        (root / split / "cat" / "gif.jpg").write_bytes(_image_bytes(cat, "GIF"))
        (root / split / "cat" / "png.jpg").write_bytes(_image_bytes(cat, "PNG"))
        whole = (root / split / "cat" / "chelsea.jpg").read_bytes()
        (root / split / "cat" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    return root


def test_files_nvimgcodec_cannot_read_go_to_the_cpu_one_by_one_counted(with_bad_files, monkeypatch):
    gpu = _batches(with_bad_files, "gpu", 0, monkeypatch, workers=0, skip_unreadable=True)
    dm_cpu = _batches(with_bad_files, "cpu", 0, monkeypatch, workers=0, skip_unreadable=True)
    gpu = [g for g in gpu if not isinstance(g, torch.Tensor)]
    # the same images in both paths, in the same order: the truncated file is skipped by both, the others decoded
    assert [y.tolist() for _, y in gpu] == [y.tolist() for _, y in dm_cpu]

    monkeypatch.setenv("LOCAL_RANK", "0")
    dm = ImageNetDataModule(str(with_bad_files), batch_size=4, num_workers=0, image_size=SIZE, decode="gpu")
    dm.setup("validate")
    batch = next(b for b in dm.val_dataloader() if any("truncated" in n for n in b.names))
    with pytest.raises(UnreadableImageError, match=r"cannot read image .*truncated\.jpg.*--data\.skip_unreadable"):
        dm.on_before_batch_transfer(batch, 0)
    dm = ImageNetDataModule(str(with_bad_files), batch_size=12, num_workers=0, image_size=SIZE, decode="gpu",
                            skip_unreadable=True)  # fmt: skip
    dm.setup("validate")
    (batch,) = list(dm.val_dataloader())
    with pytest.warns(UserWarning, match=r"nvImageCodec could not decode .*gif\.jpg: it was decoded on the CPU"):
        images, labels, *_ = dm.on_before_batch_transfer(batch, 0)  # said when it happens, once
    decoder = dm._batch_decoder
    assert [Path(p).name for p in decoder.fallbacks] == ["gif.jpg"]  # only the GIF, one by one
    assert [Path(p).name for p in decoder.skipped] == ["truncated.jpg"] and len(labels) == len(images) == 11
    with pytest.warns(UserWarning, match=r"rank 0: 1 image\(s\) nvImageCodec could not decode .*gif\.jpg"):
        dm.teardown("validate")


def test_auto_decodes_on_the_gpu_only_on_cuda_and_says_why(photos):  # noqa: F811
    cpu = ImageNetDataModule.plan_lines({"data_dir": str(photos), "decode": "auto"}, cuda=False)
    assert cpu[0].startswith("decode       cpu: TorchCodec") and "(data.decode auto: the run is not on CUDA)" in cpu[0]
    assert cpu[1] == "normalise    in the loader workers (data.normalize_on_device auto: not on CUDA)"
    cuda = ImageNetDataModule.plan_lines({"data_dir": str(photos), "decode": "auto"}, cuda=True)
    said = "(data.decode auto: nvJPEG found; GPU decoding if the JPEG engine answers at the first batch, else CPU "
    assert cuda[0].startswith("decode       gpu: nvImageCodec 0.9") and f"{said}decoding)" in cuda[0], cuda
    assert cuda[1].startswith("normalise    on the device")
    given = ImageNetDataModule.plan_lines({"data_dir": str(photos), "decode": "cpu"}, cuda=True)
    assert "(data.decode cpu)" in given[0]
    dm = ImageNetDataModule(str(photos), batch_size=2, num_workers=0, image_size=SIZE)  # decode auto by default
    dm.setup("validate")
    assert dm.decoder == "cpu" and not dm.normalizes_on_device  # this machine has no CUDA


@pytest.mark.parametrize("flip", [False, True])
def test_batched_resize_is_torchs_antialiased_resize(flip):
    """Boxes of different sizes, shrunk and enlarged, resized in one batch: torch's interpolate(antialias=True) on
    each, within float rounding."""
    generator = torch.Generator().manual_seed(0)
    boxes = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=generator) for h, w in
             ((37, 50), (16, 16), (9, 30), (64, 23))]  # fmt: skip
    rows = [[0, 0, h, w, int(flip), 1, h / 24, 0.0, w / 24, 0.0] for h, w, _ in (b.shape for b in boxes)]
    out = resize_batch(boxes, 24, torch.tensor(rows, dtype=torch.float64), torch.float32)
    for box, resized in zip(boxes, out, strict=True):
        reference = F.interpolate(box.permute(2, 0, 1)[None].double(), size=(24, 24), mode="bilinear",
                                  antialias=True, align_corners=False)[0].permute(1, 2, 0)  # fmt: skip
        reference = reference.flip(1) if flip else reference
        assert (resized.double() - reference).abs().max() < 1e-3


def test_nvimgcodec_loads_without_printing_its_missing_libraries():
    """Imported plainly, nvImageCodec prints load errors for nvJPEG2000 and nvTIFF (not installed here); through the
    app nothing reaches the terminal, and what it said is kept (it tells whether nvJPEG loaded)."""
    code = "from datamodules.gpu_decode import nvimgcodec; module, said = nvimgcodec(); print(module.__version__)"
    job = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0 and job.stdout.startswith("0.9"), job.stderr[-2000:]
    assert "nvjpeg2k" not in job.stderr.lower() and "nvtiff" not in job.stderr.lower(), job.stderr
    plain = subprocess.run(
        [sys.executable, "-c", "import nvidia.nvimgcodec"], capture_output=True, text=True, timeout=120
    )
    assert "nvjpeg2k" in plain.stderr.lower()  # the noise is real: the test can fail


def test_boxes_are_resized_in_chunks_bounded_by_their_padded_pixels():
    """A batch of ImageNet-sized crops and a few crops of large photos: every box once, each chunk at most CHUNK boxes
    and PIXELS padded pixels unless it is one box alone (32 boxes padded to a 4000 x 3000 crop would be 2.3 GB)."""
    g = torch.Generator().manual_seed(0)
    sizes = [(int(h), int(w)) for h, w in torch.randint(100, 500, (250, 2), generator=g)]
    sizes += [(4000, 3000), (3000, 2500), (2000, 1800)]
    found = list(chunks(sizes))
    assert sorted(i for chunk in found for i in chunk) == list(range(len(sizes)))
    for chunk in found:
        padded = len(chunk) * max(sizes[i][0] for i in chunk) * max(sizes[i][1] for i in chunk)
        assert len(chunk) <= CHUNK and (padded <= PIXELS or len(chunk) == 1), (chunk, padded)
    assert [len(chunk) for chunk in found[-3:]] == [1, 1, 1] and len(found) <= 20


def test_the_plan_finds_nvimgcodec_without_importing_it(photos):  # noqa: F811
    """nvImageCodec's import makes an nvJPEG handle on the current device: the preflight, which every rank runs before
    Lightning sets the rank's device, must not import it (a fresh process: this one has imported it)."""
    code = f"""if True:
        import sys
        from app.launch.preflight import build
        from core.env import detect
        from datamodules.imagenet import ImageNetDataModule
        from datamodules.sources import choose_decoder, decoder_problem
        from tools.slurm import resolve_config
        config = resolve_config(["fit", "--config", "configs/imagenet.yaml", "--trainer.accelerator", "gpu",
                                 "--trainer.default_root_dir", "/tmp/plan-test", "--data.data_dir", {str(photos)!r}])
        text = build(config, launch=detect({{}})).render()
        assert "GPU decoding if the JPEG engine answers at the first batch" in text, text
        for decode in ("auto", "gpu"):
            (line, *_) = ImageNetDataModule.plan_lines({{"data_dir": {str(photos)!r}, "decode": decode}}, cuda=True)
            assert line.startswith("decode       gpu: nvImageCodec"), line
            assert decoder_problem(*choose_decoder(decode, True), True) is None
        print("imported:", [name for name in sys.modules if "nvimgcodec" in name])
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported: []" in done.stdout, done.stdout


def test_auto_says_when_nvimgcodec_is_not_installed(photos, monkeypatch):  # noqa: F811
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "nvimgcodec" in name else find_spec(name))
    (line, *_) = ImageNetDataModule.plan_lines({"data_dir": str(photos), "decode": "auto"}, cuda=True)
    assert line.startswith("decode       cpu: ") and "(data.decode auto: nvImageCodec not installed: pip " in line
    problem = decoder_problem(*choose_decoder("gpu", True), True)
    assert problem.startswith("data.decode gpu: nvImageCodec not installed: pip install nvidia-nvimgcodec-cu")


class HardwareStandIn:
    """nvImageCodec's ``Decoder`` as its hardware backend behaves on a corrupt file (a test double of the third-party
    decoder, which needs a GPU): a batch holding a ``bad`` image fails whole (every result None, or it raises);
    otherwise the real CPU-backend decoder decodes it. ``calls`` counts the images of each call."""

    def __init__(self, real, bad: set[tuple[int, int]], raises: bool = False) -> None:
        self.real, self.bad, self.raises, self.calls = real, bad, raises, []

    def decode(self, streams, params=None, cuda_stream=0):
        self.calls.append(len(streams))
        if any((s.height, s.width) in self.bad for s in streams):
            if self.raises:
                raise RuntimeError("nvJPEG hardware decode failed (NVJPEG_STATUS_EXECUTION_FAILED)")
            return [None] * len(streams)
        return self.real.decode(streams, params=params, cuda_stream=cuda_stream)


def _val_batch(data_dir: Path, size: int = 12) -> EncodedBatch:
    dm = ImageNetDataModule(str(data_dir), batch_size=size, num_workers=0, image_size=SIZE, decode="gpu")
    dm.setup("validate")
    return next(iter(dm.val_dataloader()))


@pytest.mark.parametrize("raises", [False, True])
def test_a_bad_file_in_a_hardware_batch_costs_that_file_alone(photos, raises):  # noqa: F811
    """The hardware backend fails a whole batch for one corrupt file: the batch is decoded again in halves until that
    file is found, and only it goes to the CPU (counted); the batch equals the one decoded without the failure."""
    batch = _val_batch(photos, 9)
    shapes = [Image.open(name).size[::-1] for name in batch.names]
    bad = next(i for i, shape in enumerate(shapes) if shapes.count(shape) == 1)  # the stand-in knows it by its size
    expected, labels = BatchDecoder(torch.device("cpu"))(batch)
    shape = shapes[bad]
    stand_ins = []

    def opener(module, device, threads, hardware):
        stand_ins.append(HardwareStandIn(open_decoder(module, device, threads, hardware), set(), raises))
        return stand_ins[-1]

    decoder = BatchDecoder(torch.device("cpu"), opener=opener)
    decoder(batch)  # a good first batch (the first-run guard takes a first batch that fails whole for a broken backend)
    stand_ins[0].bad.add(shape)
    with pytest.warns(UserWarning, match=r"nvImageCodec could not decode .*: it was decoded on the CPU"):
        images, got = decoder(batch)
    assert decoder.fallbacks == [batch.names[bad]] and decoder.skipped == [] and torch.equal(got, labels)
    # the other 8 images decoded by nvImageCodec in halves (9, then 4 and 5, then the failing half's halves, ...: two
    # calls per halving, about two batches' worth of images); the bad one alone on the CPU (PIL or TorchCodec: within a
    # few levels of nvImageCodec's CPU backend)
    calls = stand_ins[0].calls[1:]
    assert calls[0] == 9 and len(calls) <= 1 + 2 * math.ceil(math.log2(9)) and sum(calls) <= 3 * 9, calls
    others = [i for i in range(len(batch)) if i != bad]
    assert torch.equal(images[others], expected[others])
    assert ((images[bad] - expected[bad]).abs() * 255 * min(STD)).mean() < 3


def test_a_jpeg_cut_short_goes_to_the_cpu_path_even_if_nvimgcodec_would_decode_it(with_bad_files):
    """nvJPEG may decode a truncated JPEG half and report success: such a file is never given to nvImageCodec, and
    the CPU path calls it unreadable, as it does without GPU decoding."""
    whole = (with_bad_files / "val" / "cat" / "chelsea.jpg").read_bytes()
    cut = np.frombuffer(whole[: len(whole) // 2], dtype=np.uint8)
    assert truncated(cut) and not truncated(np.frombuffer(whole, dtype=np.uint8))
    assert not truncated(np.frombuffer(whole + b"\0" * 10, dtype=np.uint8))  # padding after the end marker
    assert not truncated(np.frombuffer(_image_bytes(Image.open(io.BytesIO(whole)), "PNG"), dtype=np.uint8))


def test_decoding_on_a_side_stream_hands_the_results_to_the_training_stream():
    """The order of the stream calls (CUDA's, on stand-ins): the work runs with the side stream current, then the
    training stream waits for the side stream, then each device tensor is recorded on the training stream."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    class Streams:
        current = "main"

        @contextlib.contextmanager
        def stream(self, stream):
            log.append(f"enter {stream.name}")
            Streams.current, before = stream.name, Streams.current
            yield
            Streams.current = before
            log.append(f"leave {stream.name}")

    class DeviceTensor:
        is_cuda = True

        def record_stream(self, stream):
            log.append(f"images recorded on {stream.name}")

    def work():
        log.append(f"decode on {Streams.current}")
        return DeviceTensor(), torch.zeros(2)  # the labels stay on the host: nothing to record

    side, main = Stream("side"), Stream("main")
    out = on_side_stream(work, side, main, Streams())
    assert log == ["enter side", "decode on side", "leave side", "main waits for side", "images recorded on main"]
    assert isinstance(out[0], DeviceTensor)


def test_decoder_threads_are_this_processes_cores_less_its_loader_workers(photos, monkeypatch):  # noqa: F811
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    dm = ImageNetDataModule(str(photos), batch_size=3, num_workers=2, image_size=SIZE, decode="gpu")
    dm.trainer = pl.Trainer(accelerator="cpu", devices=4, strategy="ddp", logger=False)
    dm.setup("validate")
    assert dm.decode_threads == 16 // 4 - 2
    dm.num_workers = 7
    dm.setup("validate")
    assert dm.decode_threads == 1  # never 0: nvImageCodec would start one thread per core


class Batches(pl.Callback):
    """The batches the training steps get (after the device stage)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch[0].detach().clone(), batch[1].clone()))


def _fit(data_dir: Path, root: Path, opener=None) -> tuple[list, list[str]]:
    """A real fit of 3 steps (18 photos, batch 6) and one validation batch under data.decode gpu; the batches trained
    on and the warnings said."""
    dm = ImageNetDataModule(str(data_dir), batch_size=6, num_workers=0, image_size=32, decode="gpu")
    if opener is not None:
        dm.decoder_opener = opener
    torch.manual_seed(0)
    model = ImageClassifier(arch="resnet18", num_classes=dm.num_classes, in_channels=3)
    batches = Batches()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[batches],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    return batches.seen, [str(w.message) for w in said]


def test_gpu_decoding_that_fails_at_its_first_batch_continues_on_the_cpu(photos, tmp_path):  # noqa: F811
    """The first-run guard: no decoder can be made (nvImageCodec raises) in a real fit: the run says so in one line
    and trains on the same batches, decoded on the CPU (the first one too), to the end."""
    tries = []

    def failing(module, device, threads, hardware):
        tries.append(hardware)
        raise RuntimeError("Could not create decoder. Code: 7")

    guarded, said = _fit(photos, tmp_path / "guarded", failing)
    lines = [line for line in said if "continuing with CPU decoding" in line]
    assert lines == [
        "GPU decoding failed at its first batch: no decoder (Could not create decoder. Code: 7); continuing with CPU "
        "decoding in the training process (--data.decode cpu decodes in the loader workers, faster)"
    ], said
    assert tries == [True, False]  # the hardware decoder, then any decoder; once for the run (validation included)
    reference, _ = _fit(photos, tmp_path / "reference")
    assert len(guarded) == len(reference) == 3
    for (x, y), (x_ref, y_ref) in zip(guarded, reference, strict=True):
        assert torch.equal(y, y_ref) and x.shape == x_ref.shape == (6, 3, 32, 32)  # nothing lost
        assert ((x - x_ref).abs() * 255 * min(STD)).mean() < 3  # PIL / TorchCodec against nvImageCodec's CPU backend


def test_auto_without_a_jpeg_engine_says_so_and_decodes_on_the_cpu(photos):  # noqa: F811
    def no_engine(module, device, threads, hardware):
        raise RuntimeError("Could not create decoder. Code: 7")  # what nvImageCodec says on a GPU without NVJPG

    batch = _val_batch(photos, 9)
    decoder = BatchDecoder(torch.device("cpu"), hardware_only=True, opener=no_engine)
    with pytest.warns(UserWarning, match=r"^decode cpu: this GPU has no JPEG engine \(T4/A10/L40S class\): no hardwa"):
        images, labels = decoder(batch)
    assert decoder.decoder is None and decoder.fallbacks == [] and len(images) == len(labels) == 9
    expected, _ = BatchDecoder(torch.device("cpu"))(batch)
    assert ((images - expected).abs() * 255 * min(STD)).mean() < 3


def test_a_backend_that_decodes_nothing_at_the_first_batch_is_given_up(photos):  # noqa: F811
    batch = _val_batch(photos, 9)
    shapes = {Image.open(name).size[::-1] for name in batch.names}

    def silent(module, device, threads, hardware):  # every image refused, alone too
        return HardwareStandIn(open_decoder(module, device, threads, hardware), shapes)

    decoder = BatchDecoder(torch.device("cpu"), opener=silent)
    with pytest.warns(UserWarning, match=r"first batch \(nvImageCodec decoded none of its 9 JPEGs\); continuing with"):
        images, _ = decoder(batch)
    assert decoder.decoder is None and decoder.fallbacks == [] and len(images) == 9
