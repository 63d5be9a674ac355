"""AMP on CUDA: 16-mixed with Lightning's real GradScaler, bf16-mixed, dp + AMP, rank-local checkpoint loading."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from app.callbacks import AMPHealth, Throughput
from app.checkpoint import AtomicCheckpointIO
from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.conftest import run_if


class InfInGradient(Callback):
    def __init__(self, batches: set[int]) -> None:
        self.batches = batches

    def on_after_backward(self, trainer, pl_module):
        if trainer.fit_loop.epoch_loop.batch_idx in self.batches:
            pl_module.net[-1].weight.grad[0, 0] = float("inf")


def cuda_trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cuda", devices=1, max_epochs=1, limit_train_batches=30, limit_val_batches=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path, log_every_n_steps=1,
    )  # fmt: skip
    return Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def per_step_sgd() -> ImageClassifier:
    return ImageClassifier(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.99),
        lr_scheduler_interval="step",
    )


@run_if(cuda=1)
def test_fp16_mixed_uses_the_real_grad_scaler_on_cuda(mnist_dir, tmp_path):
    seed_everything(0)
    amp = AMPHealth(message_interval_steps=1)
    trainer = cuda_trainer(tmp_path, [InfInGradient({3, 10}), amp, Throughput()], precision="16-mixed")
    trainer.fit(per_step_sgd(), MNISTDataModule(data_dir=str(mnist_dir), batch_size=64))
    assert type(trainer.precision_plugin.scaler).__name__ == "GradScaler" and trainer.precision == "16-mixed"
    assert amp.skipped_steps >= 2  # the two injected overflows (plus any the scaler found by itself)
    assert trainer.callback_metrics["amp/skipped_steps"] == amp.skipped_steps
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 30 - amp.skipped_steps
    assert trainer.callback_metrics["val/acc1"] > 0.7
    assert trainer.callback_metrics["perf/images_per_sec"] > 0


@run_if(cuda=1)
def test_bf16_mixed_trains_on_cuda(mnist_dir, tmp_path):
    seed_everything(0)
    trainer = cuda_trainer(tmp_path, [AMPHealth()], precision="bf16-mixed")
    trainer.fit(per_step_sgd(), MNISTDataModule(data_dir=str(mnist_dir), batch_size=64))
    assert trainer.callback_metrics["val/acc1"] > 0.7 and "amp/loss_scale" not in trainer.callback_metrics


@run_if(cuda=2)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_dp_with_amp(mnist_dir, tmp_path, precision):
    import app.strategies  # noqa: F401  (registers "dp")

    seed_everything(0)
    amp = AMPHealth()
    trainer = cuda_trainer(tmp_path, [amp, Throughput()], precision=precision, devices=2, strategy="dp")
    trainer.fit(per_step_sgd(), MNISTDataModule(data_dir=str(mnist_dir), batch_size=128))
    assert trainer.callback_metrics["val/acc1"] > 0.7
    assert trainer.callback_metrics["perf/images_per_sec_per_device"] == pytest.approx(
        trainer.callback_metrics["perf/images_per_sec"] / 2
    )
    if precision == "16-mixed":  # GradScaler: starts at 2^16, halves at each skipped step, grows after 2000 good ones
        assert trainer.callback_metrics["amp/loss_scale"] == 2.0**16 / 2**amp.skipped_steps


@run_if(cuda=2)
def test_checkpoint_loads_onto_the_ranks_own_device(tmp_path):
    io = AtomicCheckpointIO()
    with torch.cuda.device(0):
        io.save_checkpoint({"w": torch.ones(3, device="cuda:0")}, tmp_path / "x.ckpt")
    with torch.cuda.device(1):  # what Lightning sets up on rank 1
        loaded = io.load_checkpoint(tmp_path / "x.ckpt")
    assert loaded["w"].device == torch.device("cuda", 1)
