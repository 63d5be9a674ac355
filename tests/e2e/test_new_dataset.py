"""A new data set costs what docs/explanation/architecture.md says: one DataModule and one recipe config, no other file.

The DataModule is defined here (``Stripes``: IDX files this test writes, 28x28 images of horizontal, vertical and
diagonal stripes under noise, 3 classes), the recipe is a YAML file written next to the data, and the app's real CLI
runs fit, validate, test and a resume with ``--ckpt_path last``. Nothing in the repository names ``Stripes``: the CLI
finds it through ``data.class_path``, and the model is told its classes and channels (``core.datamodule.ImageData``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app.command import main
from core.datamodule import ImageData
from datamodules.base import ImageDataModule, Workers

SIDE, PER_CLASS = 28, {"train": 64, "val": 16, "test": 24}


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (MNIST's format): 0, 0, the type (0x08: unsigned byte), the number of dimensions, each size as a
    big-endian int32, then the data."""
    path.write_bytes(bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape) + array.tobytes())


def read_idx(path: Path) -> torch.Tensor:
    data = path.read_bytes()
    ndim = data[3]
    shape = struct.unpack(f">{ndim}i", data[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).reshape(shape)


def write_stripes(folder: Path, seed: int = 0) -> Path:
    """``{train,val,test}-images.idx`` and ``-labels.idx``: class 0 horizontal, 1 vertical, 2 diagonal stripes."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:SIDE, 0:SIDE]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in PER_CLASS.items():
        images, labels = [], []
        for label, lines in enumerate((rows, cols, rows + cols)):
            for _ in range(n):
                period, phase = rng.integers(3, 7), rng.integers(0, 7)
                stripes = ((lines + phase) % period < period // 2) * 200.0
                images.append(np.clip(stripes + rng.normal(0, 40, (SIDE, SIDE)), 0, 255).astype(np.uint8))
                labels.append(label)
        write_idx(folder / f"{split}-images.idx", np.stack(images))
        write_idx(folder / f"{split}-labels.idx", np.array(labels, dtype=np.uint8))
    return folder


class Stripes(ImageDataModule):
    """The whole new data set: where the files are, what one image is, which loader serves each split."""

    num_classes = 3
    in_channels = 1
    input_shape = (1, SIDE, SIDE)

    def __init__(
        self, data_dir: str, batch_size: int = 16, num_workers: Workers = 0, global_batch_size: int | None = None
    ) -> None:
        super().__init__(batch_size=batch_size, global_batch_size=global_batch_size, num_workers=num_workers)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)

    def _split(self, name: str) -> TensorDataset:
        images = read_idx(self.data_dir / f"{name}-images.idx").float().div(255).sub(0.5).unsqueeze(1)
        return TensorDataset(images, read_idx(self.data_dir / f"{name}-labels.idx").long())

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)  # the batch arithmetic (core.batch), the workers' check
        self.train_set, self.val_set, self.test_set = (self._split(name) for name in PER_CLASS)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)  # resumable, sharded by Lightning's sampler

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)  # unpadded: every image evaluated once

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)


def run(*args: str) -> object:
    return main([*args, "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"])


def metric(cli, key: str) -> float:
    return float(cli.trainer.callback_metrics[key])


@pytest.mark.slow
def test_a_new_dataset_is_one_datamodule_and_one_recipe(tmp_path, caplog):
    data = write_stripes(tmp_path / "stripes")
    recipe = tmp_path / "stripes.yaml"  # a recipe states only what differs from configs/base.yaml
    recipe.write_text(
        f"trainer:\n  max_epochs: 2\n  default_root_dir: {tmp_path / 'runs'}\n"
        "model:\n  arch: mnist_cnn\n  optimizer:\n    class_path: torch.optim.Adam\n    init_args:\n      lr: 0.003\n"
        f"data:\n  class_path: {__name__}.Stripes\n  init_args:\n    data_dir: {data}\n"
    )
    assert isinstance(Stripes(str(data)), ImageData)

    fit = run("fit", "--config", str(recipe))
    assert fit.trainer.current_epoch == 2 and fit.model.hparams.num_classes == 3  # linked from the DataModule
    assert "val: evaluated 48/48 images" in caplog.text  # 3 classes x 16, each once
    accuracy = metric(fit, "val/acc1")
    assert accuracy > 0.9, accuracy  # stripes are easy: far above the 1/3 of chance
    steps = fit.trainer.global_step
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"

    validate = run("validate", "--config", str(recipe), "--ckpt_path", "last")
    assert metric(validate, "val/acc1") == pytest.approx(accuracy)  # the same weights, the same 48 images

    test = run("test", "--config", str(recipe), "--ckpt_path", "last")
    assert "test: evaluated 72/72 images" in caplog.text
    assert metric(test, "test/acc1") > 0.9

    resumed = run("fit", "--config", str(recipe), "--ckpt_path", "last", "--trainer.max_epochs", "3")
    assert resumed.trainer.current_epoch == 3 and resumed.trainer.global_step == steps * 3 // 2
    assert Path(resumed.trainer.log_dir) == last.parents[1]  # the fit's run folder continued (version_0)
