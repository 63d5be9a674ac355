"""The GPU code paths' defects that only a GPU can show (the CPU half is tests/unit/test_gpu_paths.py).

Run on one H200 by ``make gpu-check CALL=A`` (its ``tests/gpu`` step; bench/results/gpu_check_A.md): the tests
that need two CUDA devices are skipped there.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import app.strategies  # noqa: F401  (registers the strategy names)
from app.callbacks import Throughput
from app.callbacks.rng import _local_rng_state, _set_local_rng_state
from app.strategies import DDPModelParallelStrategy
from datamodules import ImageNetDataModule, MNISTDataModule
from datamodules.base import normalize
from modules import ImageClassifier
from tests.conftest import run_cli, run_if, short_fit


def _trainer(tmp_path, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cuda", devices=1, max_steps=4, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, log_every_n_steps=1,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


def _synthetic(batch_size: int = 8) -> ImageNetDataModule:
    return ImageNetDataModule(
        batch_size=batch_size, num_workers=0, image_size=32, synthetic=True, synthetic_train_size=64,
        synthetic_val_size=16, num_classes=10,
    )  # fmt: skip


@run_if(cuda=1)
def test_normalize_makes_no_blocking_copy_after_the_first_batch():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, device="cuda")
    normalize(images)  # the first call builds the statistics on the device
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = normalize(images)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.dtype == torch.float32 and out.device == images.device


@run_if(cuda=1)
def test_rng_restore_with_fewer_visible_gpus_than_saved_states():
    torch.cuda.init()
    state = _local_rng_state()
    expected = torch.rand(3, device="cuda:0")
    saved = {**state, "cuda": state["cuda"] * 2}  # as saved by a run that saw twice as many GPUs
    _set_local_rng_state(saved)  # raised IndexError: more saved CUDA states than visible devices
    assert torch.equal(torch.rand(3, device="cuda:0"), expected)


class _Losses(Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(float(outputs["loss"]))


@run_if(cuda=1)
@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_true_precisions_train_the_imagenet_datamodule(tmp_path, precision):
    """With the default Adam: under 16-true its eps=1e-8 was 0 in fp16 and the weights NaN after one step."""
    seed_everything(0)
    model = ImageClassifier(arch="resnet18", num_classes=10, in_channels=3)
    losses = _Losses()
    trainer = _trainer(tmp_path, precision=precision, max_steps=12, limit_val_batches=0, callbacks=[losses])
    trainer.fit(model, _synthetic())  # 64 synthetic images: 8 batches an epoch, the same ones again after
    dtype = {"16-true": torch.float16, "bf16-true": torch.bfloat16}[precision]
    assert trainer.global_step == 12 and next(model.parameters()).dtype == dtype
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(losses.seen[-4:]) < sum(losses.seen[:4]), losses.seen


class _Devices(Callback):
    def on_train_end(self, trainer, pl_module):
        self.devices = {p.device for p in pl_module.parameters()}


@run_if(cuda=2)
def test_ddp_mp_two_stages_on_nccl_fit_and_teardown(tmp_path):
    """NCCL must not be bound to the first stage's GPU; blocks are cut whole; hooks are gone after fit."""
    seed_everything(0)
    model = ImageClassifier(arch="resnet18", num_classes=10, in_channels=3)
    strategy = DDPModelParallelStrategy(devices_per_process=2)
    devices = _Devices()
    trainer = _trainer(tmp_path, strategy=strategy, callbacks=[Throughput(window=2), devices])
    trainer.fit(model, _synthetic())
    assert trainer.global_step == 4
    assert devices.devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
    metrics = trainer.callback_metrics
    assert metrics["perf/images_per_sec_per_device"] == pytest.approx(metrics["perf/images_per_sec"] / 2)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


@run_if(cuda=2)
def test_dp_refuses_a_compiled_model(mnist_dir, tmp_path):
    model = ImageClassifier(arch="mnist_cnn", compile=True)
    with pytest.raises(RuntimeError, match="dp cannot run a compiled model"):
        _trainer(tmp_path, devices=2, strategy="dp").fit(model, MNISTDataModule(data_dir=str(mnist_dir)))


@run_if(cuda=2)
def test_dp_replicas_keep_channels_last_weights(mnist_dir, tmp_path):
    model = ImageClassifier(arch="mnist_cnn", channels_last=True)
    seen: dict[int, bool] = {}

    def record(module, args, output):
        seen[module.weight.device.index] = module.weight.is_contiguous(memory_format=torch.channels_last)

    model.net[0].register_forward_hook(record)
    _trainer(tmp_path, devices=2, strategy="dp", max_steps=2).fit(model, MNISTDataModule(data_dir=str(mnist_dir)))
    assert seen == {0: True, 1: True}


@run_if(cuda=1)
def test_default_callbacks_train_without_a_host_sync_between_logging_steps(mnist_dir, tmp_path):
    """The steady-state step of the default config (its per-step callbacks, 32-true) under
    ``set_sync_debug_mode("error")``: any blocking CUDA call outside logging steps raises."""
    from app.callbacks import AMPHealth, LostRank, RNGState, SIGTERMCheckpoint, SLURMRequeue, Throughput
    from core.logging_steps import is_logging_step

    class SyncGuard(Callback):
        checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strict = batch_idx >= 2 and not is_logging_step(trainer)
            torch.cuda.set_sync_debug_mode("error" if strict else 0)
            self.checked += strict

        def on_train_epoch_end(self, *args):
            torch.cuda.set_sync_debug_mode(0)

    guard = SyncGuard()
    # the guard first: Lightning calls callbacks in list order, so it resets before AMPHealth's allowed epoch-end read
    # (24 steps end on a non-logging step: last, the guard reported that read as a sync)
    callbacks = [guard, AMPHealth(), Throughput(), SLURMRequeue(), RNGState(), SIGTERMCheckpoint(), LostRank()]
    trainer = _trainer(tmp_path, max_steps=24, limit_val_batches=0, log_every_n_steps=10, callbacks=callbacks)
    try:
        trainer.fit(ImageClassifier(arch="mnist_fast"), MNISTDataModule(data_dir=str(mnist_dir), batch_size=64))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 24 and guard.checked >= 18


@run_if(cuda=1)
def test_dp_replica_step_makes_no_blocking_copy():
    """Each replica's step under dp: its batch size was a blocking host-to-device copy (``new_tensor([n])``)."""
    import contextlib

    from app.strategies.dp import StepDispatcher

    model = ImageClassifier(arch="mnist_fast").cuda()
    dispatcher = StepDispatcher(model, contextlib.nullcontext)
    batch = (torch.randn(8, 1, 28, 28, device="cuda"), torch.randint(0, 10, (8,), device="cuda"))
    dispatcher("training_step", batch)  # the first call may initialise cuDNN/cuBLAS
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dispatcher("training_step", batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out["batch_size"].device == batch[1].device and out["batch_size"].tolist() == [8.0]


@run_if(cuda=1)
def test_a_fit_resumes_from_last_ckpt_on_cuda(mnist_dir, tmp_path):
    """A fit stopped by SIGTERM mid-epoch resumes with ``--ckpt_path last`` on a GPU: the checkpoint is loaded onto
    the device while the model is still on the host, and the epoch's training sums it carries must join the model's
    (they stopped the resume with a device mismatch)."""
    args = [*short_fit(tmp_path, mnist_dir, train_batches=6, val_batches=2), "--trainer.accelerator", "cuda",
            "--trainer.devices", "1"]  # fmt: skip
    stopped = run_cli("fit", *args, "--trainer.callbacks+=tools.resume_probe.SignalAt", "--trainer.callbacks.step", "3")
    assert list(tmp_path.rglob("last.ckpt")), stopped.stderr[-3000:]
    resumed = run_cli("fit", *args, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume from" in resumed.stdout + resumed.stderr
