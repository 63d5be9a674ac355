"""The app's DataModules meet the contract the app and the model read (``core.datamodule.ImageData``), and a class
that lacks a part of it does not."""

from __future__ import annotations

from lightning.pytorch import LightningDataModule

from core.datamodule import ImageData
from datamodules import ImageNetDataModule, MNISTDataModule


def test_every_datamodule_of_the_app_meets_the_contract(tmp_path):
    for datamodule in (MNISTDataModule(data_dir=str(tmp_path)), ImageNetDataModule(synthetic=True)):
        assert isinstance(datamodule, ImageData), type(datamodule).__name__
        assert datamodule.config_problems({}) == []
    assert MNISTDataModule.input_shape == (1, 28, 28) and ImageNetDataModule.random_transforms


def test_a_datamodule_without_classes_or_channels_is_not_one():
    class Bare(LightningDataModule):
        batch_size = 8

    assert not isinstance(Bare(), ImageData)
