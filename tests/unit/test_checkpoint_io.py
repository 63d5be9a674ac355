"""Checkpoints: atomic writes that survive a failing save, safe and rank-local loads, wired in by default."""

from __future__ import annotations

import os
import stat
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from app.callbacks import RNGState
from app.checkpoint import AtomicCheckpointIO, UnsafeCheckpointError
from app.command import main
from datamodules import MNISTDataModule
from modules import ImageClassifier


class Unpicklable:
    """Stands for anything that makes ``torch.save`` fail halfway through (disk full, an odd object, a crash)."""

    def __reduce__(self):
        raise OSError("simulated failure in the middle of writing the checkpoint")


class BreaksFourthSave(Callback):
    """Its state poisons the 4th checkpoint: epoch 1's ``last.ckpt`` (each epoch saves its top-k file, then last)."""

    def __init__(self) -> None:
        self.saves = 0

    def state_dict(self):
        self.saves += 1
        return {"payload": torch.zeros(1000), "poison": Unpicklable() if self.saves == 4 else None}


def test_failed_save_leaves_the_previous_checkpoint_intact(mnist_dir, tmp_path):
    """Epoch 0 saves last.ckpt; overwriting it at the end of epoch 1 fails midway: last.ckpt is still epoch 0's."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1, every_n_epochs=1)
    trainer = Trainer(
        accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt, BreaksFourthSave()],
        plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(OSError, match="simulated failure"):
        trainer.fit(ImageClassifier(), MNISTDataModule(data_dir=str(mnist_dir), batch_size=4))
    saved = AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert saved["epoch"] == 0 and saved["global_step"] == 2
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    saved = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]  # and each one's SHA-256; no partial file
    assert files == sorted(saved + [f"{name}.sha256" for name in saved]), files


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_checkpoint_mode_follows_the_umask_like_the_runs_other_files(tmp_path, umask):
    """A shared project folder: the team reads the checkpoints exactly as it reads the run's config and logs."""
    previous = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"w": torch.ones(3)}, tmp_path / "last.ckpt")
        (tmp_path / "config.yaml").write_text("x: 1\n")  # how every other file of a run is created
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "last.ckpt").stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode)


def test_save_replaces_and_loads_with_weights_only(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "x.ckpt"
    io.save_checkpoint({"w": torch.ones(3), "step": 1}, path)
    io.save_checkpoint({"w": torch.full((3,), 2.0), "step": 2}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a safe load needs no fallback
        loaded = io.load_checkpoint(path)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.full((3,), 2.0))
    assert loaded["w"].device == torch.device("cpu")  # this rank's own device (no CUDA here)


class Custom:
    def __init__(self) -> None:
        self.value = 3


def test_unsafe_checkpoint_is_refused_unless_weights_only_is_off(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"obj": Custom()}, tmp_path / "c.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="Custom.*--trust_checkpoint true"):  # no silent fallback
        io.load_checkpoint(tmp_path / "c.ckpt")
    assert io.load_checkpoint(tmp_path / "c.ckpt", weights_only=False)["obj"].value == 3
    assert AtomicCheckpointIO(weights_only=False).load_checkpoint(tmp_path / "c.ckpt")["obj"].value == 3


def test_default_config_uses_atomic_io_and_rng_state(tmp_path):
    cli = main(["--trainer.default_root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert any(isinstance(cb, RNGState) for cb in cli.trainer.callbacks)
    (checkpoint,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert checkpoint.save_last and checkpoint.monitor == "val/acc1" and checkpoint.mode == "max"
