"""dp on real GPUs: parity with one device (the modern recipe too), fit/validate/test/predict, autocast inside the
replicas."""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.conftest import ROOT, run_if
from tools.parity import compare
from tools.photos import build_photo_imagenet

pytestmark = run_if(cuda=2)
SGD = ["--model.optimizer", "SGD", "--model.optimizer.lr", "0.05", "--model.optimizer.momentum", "0.9"]


@pytest.fixture
def no_tf32():
    """TF32 convolutions round differently for differently sized batches; parity is stated for true fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_dp_matches_single_device(mnist_dir, tmp_path, no_tf32):
    scenario = {
        "name": "plain",
        "args": [
            "--data.data_dir",
            str(mnist_dir),
            "--data.batch_size",
            "8",
            "--model.arch",  # no BatchNorm: per-replica statistics make the default mnist_fast differ by design
            "mnist_cnn",
            *SGD,
            "--trainer.limit_train_batches",
            "3",
        ],
        "modes": ["ddp"],
    }
    results = compare([scenario], steps=6, nproc=2, workdir=tmp_path, accelerator="auto")
    facts = results["scenarios"]["plain"]["modes"]["dp"]
    assert facts["max_diff_vs_single"] < 1e-5, facts


def test_dp_matches_single_device_with_the_modern_recipe(tmp_path, no_tf32):
    """The modern ImageNet recipe on the test photos (decoded on the GPU, mixup/cutmix, repeated augmentation, the
    moving average every step): dp splits each batch over its 2 GPUs and mixes each GPU's share as a ddp rank would,
    so it ends with the one device's average and training weights. A network without BatchNorm (DataParallel's
    replicas normalise each share by itself, which no single device reproduces)."""
    photos = build_photo_imagenet(tmp_path / "photos")
    scenario = {
        "name": "modern",
        "args": [
            "--config",
            str(ROOT / "configs" / "imagenet_modern.yaml"),
            "--data.data_dir",
            str(photos),
            "--model.arch",
            "mnist_cnn",
            "--data.image_size",
            "28",
            "--data.batch_size",
            "3",
            "--data.num_workers",
            "0",
            "--trainer.precision",
            "32-true",
            "--model.compile",
            "false",
            "--model.channels_last",
            "false",
            "--trainer.limit_train_batches",
            "3",
            "--model.warmup_epochs",
            "1",
            "--model.optimizer.init_args.lr",
            "20",
            "--ema.torchvision_decay",
            "0.95",
            "--ema.update_every_n_steps",
            "1",
        ],  # fmt: skip
        "modes": ["ddp"],
    }
    results = compare([scenario], steps=6, nproc=2, workdir=tmp_path, accelerator="auto")
    facts = results["scenarios"]["modern"]["modes"]
    for mode in ("ddp", "dp"):
        assert facts[mode]["max_diff_vs_single"] < 1e-5 and facts[mode]["training_max_diff_vs_single"] < 1e-5, facts


def test_dp_fit_validate_test_predict_with_autocast_in_every_replica(mnist_dir, tmp_path):
    seed_everything(0)
    model = ImageClassifier(arch="mnist_cnn")
    seen: list[tuple[torch.device, bool, torch.dtype]] = []
    lock = threading.Lock()

    def record(module, args, output):
        with lock:
            seen.append((output.device, torch.is_autocast_enabled("cuda"), output.dtype))

    model.net[0].register_forward_hook(record)  # replicas copy the hooks of the module they replicate
    trainer = Trainer(
        accelerator="cuda", devices=2, strategy="dp", precision="bf16-mixed", max_epochs=1, limit_train_batches=20,
        limit_val_batches=4, limit_test_batches=4, limit_predict_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    datamodule = MNISTDataModule(data_dir=str(mnist_dir), batch_size=64)
    trainer.fit(model, datamodule)
    assert {d.index for d, _, _ in seen} == {0, 1}, "the batch was not split across both GPUs"
    assert all(enabled and dtype == torch.bfloat16 for _, enabled, dtype in seen), "autocast missing in a replica"
    assert trainer.callback_metrics["val/acc1"] > 0.5
    (tested,) = trainer.test(model, datamodule, verbose=False)
    assert tested["test/acc1"] > 0.5
    predictions = trainer.predict(model, datamodule)
    assert predictions[0]["pred"].shape == (64,)  # gathered from both GPUs
