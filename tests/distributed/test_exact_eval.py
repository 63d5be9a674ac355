"""Exact evaluation under 2-process DDP (gloo, CPU): an odd number of validation images, each counted once.

One launched job (``cli.py fit`` with configs/imagenet.yaml on the real-photo folder) checks: the global batch is
split into per-device batches, the LR is scaled and stated, the 9 validation photos are reported as "evaluated 9/9"
although the ranks get 5 and 4 of them, and the metrics the 2 processes computed equal those of one process
evaluating the same weights (a padded sampler would have counted one photo twice).
"""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch

from datamodules.imagenet import ImageNetDataModule
from modules import ImageClassifier
from tests.conftest import run_cli
from tools.photos import build_photo_imagenet

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_process_validation_counts_every_image_once(tmp_path):
    photos = build_photo_imagenet(tmp_path / "imagenet", max_side=96)
    run_dir = tmp_path / "run"
    done = run_cli(
        "fit",
        "--config", "configs/imagenet.yaml",
        "--data.data_dir", str(photos),
        "--data.image_size", "32",
        "--data.global_batch_size", "4",
        "--data.num_workers", "0",
        "--model.arch", "resnet18",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "2",
        "--trainer.strategy", "ddp",
        "--trainer.max_epochs", "1",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(run_dir),
        "--trainer.default_root_dir", str(run_dir),
        timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "data.global_batch_size 4: batch 2 per device x 2 processes x 1 accumulated = global batch 4" in output
    assert "learning rate 0.0015625 = 0.1 per 256 images x global batch 4 / 256 (linear scaling" in output
    assert "val: evaluated 9/9 images" in output
    assert "replicates some samples" not in output  # Lightning's padding warning: no DistributedSampler for val

    rows = list(csv.DictReader(next(run_dir.rglob("metrics.csv")).open()))
    distributed = {k: float(v) for row in rows for k, v in row.items() if k.startswith("val/") and v}
    checkpoint = next(run_dir.rglob("last.ckpt"))
    # the same weights evaluated by one process over the whole validation folder
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=False)
    dm = ImageNetDataModule(data_dir=str(photos), image_size=32, batch_size=4, num_workers=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    single = trainer.validate(model, datamodule=dm, verbose=False)[0]
    assert model.evaluated["val"] == (9, 9)
    for key in ("val/acc1", "val/acc5", "val/loss"):
        assert distributed[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), (key, distributed, single)
    assert torch.isfinite(torch.tensor(single["val/loss"]))
