"""A user's run: ``python cli.py fit`` with the allreduce fragment on 2 CPU processes (Lightning's own launcher)."""

import re

import pytest

from tests.conftest import run_cli


@pytest.mark.distributed
@pytest.mark.slow
def test_allreduce_with_overlap_trains_mnist_through_the_cli(mnist_dir, tmp_path):
    result = run_cli(
        "fit", "--config", "configs/strategy/allreduce.yaml", "--trainer.strategy.init_args.overlap", "true",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "30", "--trainer.limit_val_batches", "5", "--data.batch_size", "32",
        "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(tmp_path), timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "AllReduceStrategy" in result.stdout + result.stderr
    (best,) = [p for p in (tmp_path / "version_0" / "checkpoints").glob("epoch=*.ckpt")]
    accuracy = float(re.search(r"val_acc1=([0-9.]+)\.ckpt", best.name).group(1))
    assert accuracy > 0.8, f"30 steps x 64 images should pass 80% on MNIST validation, got {accuracy}"
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
