"""A 2-process gloo fit (``cli.py fit``, CPU) that reads its training and validation images from shards."""

from __future__ import annotations

import pytest

from datamodules.shards import Options, convert
from tests.conftest import run_cli
from tools.photos import build_photo_imagenet

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_process_fit_reads_shards_and_evaluates_every_image_once(tmp_path):
    photos = build_photo_imagenet(tmp_path / "imagenet", max_side=96)
    shards = tmp_path / "shards"
    convert(photos, shards, Options(shard_images=4), progress=False)  # 5 training and 3 validation shards
    run_dir = tmp_path / "run"
    done = run_cli(
        "fit",
        "--config", "configs/imagenet.yaml",
        "--data.data_dir", str(shards),
        "--data.image_size", "32",
        "--data.global_batch_size", "4",
        "--data.num_workers", "1",
        "--model.arch", "resnet18",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "2",
        "--trainer.strategy", "ddp",
        "--trainer.max_epochs", "1",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
        timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"ImageNet data ({shards}, shards): 18 training and 9 validation images, 6 classes" in output
    assert "val: evaluated 9/9 images" in output  # the unpadded sampler over the map-style shard view
    assert "replicates some samples" not in output
