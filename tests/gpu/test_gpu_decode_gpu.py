"""``--data.decode gpu`` on a CUDA device (the CPU half, with nvImageCodec's CPU backend, is
tests/unit/test_gpu_decode.py): ``auto`` chooses it, its batches are the CPU path's crops and flips decoded by the
GPU, handed to the step in bf16 channels-last, and the files its GPU decoders refuse go to the CPU one by one.

Run by ``make gpu-check CALL=A`` (its ``tests/gpu`` step)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from datamodules.augment import STD
from datamodules.imagenet import ImageNetDataModule
from tests.conftest import run_if
from tests.unit.test_gpu_decode import SIZE, with_bad_files  # noqa: F401  (the photos with a GIF, a PNG, a cut JPEG)
from tests.unit.test_imagenet import photos  # noqa: F401  (the real-photo ImageFolder fixture)


def _batches(data_dir, decode: str, precision: str = "32-true", **kwargs) -> tuple[ImageNetDataModule, list]:
    trainer = pl.Trainer(accelerator="cuda", devices=1, precision=precision, logger=False, enable_progress_bar=False)
    dm = ImageNetDataModule(str(data_dir), batch_size=3, num_workers=1, image_size=SIZE, decode=decode, **kwargs)
    dm.trainer = trainer
    dm.setup("fit")
    out = []
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for batch in loader:
            batch = trainer.strategy.batch_to_device(dm.on_before_batch_transfer(batch, 0))
            out.append(dm.on_after_batch_transfer(batch, 0)[:2])
    return dm, out


@run_if(cuda=1)
def test_auto_decodes_on_the_gpu_the_cpu_paths_crops_in_bf16_channels_last(photos):  # noqa: F811
    gpu_dm, gpu = _batches(photos, "auto", "bf16-mixed")
    assert gpu_dm.decoder == "gpu" and gpu_dm.normalizes_on_device
    decoder = gpu_dm._batch_decoder  # the JPEG engine answered: a hardware-only decoder, nvImageCodec imported then
    assert decoder.decoder is not None and decoder.said is None and decoder.fallbacks == []
    _, cpu = _batches(photos, "cpu", "bf16-mixed")
    for (x_gpu, y_gpu), (x_cpu, y_cpu) in zip(gpu, cpu, strict=True):
        assert x_gpu.device.type == "cuda" and x_gpu.dtype == torch.bfloat16
        assert x_gpu.is_contiguous(memory_format=torch.channels_last) and torch.equal(y_gpu, y_cpu)
        # nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's, and bf16 rounds: within a few levels
        levels = (x_gpu.float() - x_cpu.float()).abs() * 255 * max(STD)
        assert levels.mean() < 3, levels.mean()
    flipped = torch.flip(gpu[0][0].float(), dims=[3])
    assert ((flipped - cpu[0][0].float()).abs() * 255 * min(STD)).mean() > 10  # the comparison can fail


@run_if(cuda=1)
def test_files_the_gpu_cannot_decode_go_to_the_cpu_one_by_one(with_bad_files):  # noqa: F811
    dm, batches = _batches(with_bad_files, "gpu", skip_unreadable=True)
    decoder = dm._batch_decoder
    assert {p.rsplit("/", 1)[-1] for p in decoder.fallbacks} <= {"gif.jpg", "png.jpg"}, decoder.fallbacks
    assert any(p.endswith("gif.jpg") for p in decoder.fallbacks)
    assert all(p.endswith("truncated.jpg") for p in decoder.skipped) and decoder.skipped
    assert sum(len(y) for _, y in batches) > 0


@run_if(cuda=1)
def test_decoding_a_batch_waits_for_no_step_in_flight(photos):  # noqa: F811
    """After the first batch, decoding, resizing and normalising one makes no synchronising torch call (a pageable
    host-to-device copy would wait for the training step queued before it)."""
    trainer = pl.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", logger=False)
    dm = ImageNetDataModule(str(photos), batch_size=6, num_workers=0, image_size=SIZE, decode="gpu")
    dm.trainer = trainer
    dm.setup("fit")
    first, second = list(dm.train_dataloader())[:2]
    dm.on_before_batch_transfer(first.pin_memory(), 0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        images, _ = dm.on_before_batch_transfer(second.pin_memory(), 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert images.is_cuda and images.dtype == torch.bfloat16


@run_if(cuda=1)
def test_the_modern_recipes_trivial_augment_and_erasing_run_on_the_gpu_as_drawn_on_the_cpu_path(photos):  # noqa: F811
    """TrivialAugmentWide and random erasing under GPU decoding: each image's operation and box drawn in the workers
    as the CPU path draws them, applied to CUDA tensors (tests/unit/test_gpu_decode.py: the same on the CPU backend)."""
    kwargs = {"trivial_augment": True, "random_erasing": 0.5}
    gpu_dm, gpu = _batches(photos, "gpu", **kwargs)
    _, cpu = _batches(photos, "cpu", normalize_on_device=True, **kwargs)
    assert gpu_dm.decoder == "gpu"
    for (x_gpu, y_gpu), (x_cpu, y_cpu) in zip(gpu, cpu, strict=True):
        assert x_gpu.device.type == "cuda" and torch.equal(y_gpu.cpu(), y_cpu.cpu())
        levels = (x_gpu.float().cpu() - x_cpu.float().cpu()).abs() * 255 * max(STD)
        assert levels.mean() < 3 and (levels > 16).float().mean() < 0.02, levels.mean()


@run_if(cuda=1)
def test_a_batch_is_decoded_on_its_own_stream_and_the_training_stream_waits_for_it(photos):  # noqa: F811
    """Decoded on the side stream while the training stream is busy (matrix products queued): the batch the training
    stream reads is the one decoded with nothing queued."""

    def decoded(busy: bool) -> tuple[ImageNetDataModule, torch.Tensor]:
        trainer = pl.Trainer(accelerator="cuda", devices=1, logger=False)
        dm = ImageNetDataModule(str(photos), batch_size=6, num_workers=0, image_size=SIZE, decode="gpu")
        dm.trainer = trainer
        dm.setup("fit")
        first, second = list(dm.train_dataloader())[:2]
        dm.on_before_batch_transfer(first, 0)
        if busy:
            work = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                work = (work @ work).clamp_(-1, 1)
        images, _ = dm.on_before_batch_transfer(second, 0)
        return dm, images.float().clone()

    dm, images = decoded(busy=True)
    assert dm._decode_stream is not None and dm._decode_stream != torch.cuda.current_stream()
    torch.cuda.synchronize()
    # a read before the decoding ended would differ wholesale; cuBLAS may round the resize's products differently
    assert torch.allclose(images, decoded(busy=False)[1], atol=1e-2)
