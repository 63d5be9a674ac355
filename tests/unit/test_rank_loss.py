"""RankEpochLoss on one real CPU run: the printed and logged epoch loss is the mean of the steps' losses."""

from __future__ import annotations

import csv
import re

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from app.callbacks import RankEpochLoss
from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.conftest import fast_trainer


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def test_each_epoch_prints_and_logs_the_mean_of_the_rank_s_step_losses(mnist_dir, tmp_path, capsys):
    torch.manual_seed(0)
    steps = StepLosses()
    logger = CSVLogger(tmp_path, name="", version=0)
    trainer = fast_trainer(
        tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=0, callbacks=[steps, RankEpochLoss()],
        logger=logger,
    )  # fmt: skip
    model = ImageClassifier(arch="tutorial_net", optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.5))
    trainer.fit(model, datamodule=MNISTDataModule(data_dir=str(mnist_dir), batch_size=16))
    printed = re.findall(r"^Rank  0 , epoch  (\d) :  ([0-9.]+)$", capsys.readouterr().out, re.MULTILINE)
    assert [epoch for epoch, _ in printed] == ["0", "1"]
    for epoch, value in printed:  # the tutorial's epoch_loss / num_batches, over this epoch's steps only
        expected = sum(steps.losses[3 * int(epoch) : 3 * int(epoch) + 3]) / 3
        assert abs(float(value) - expected) < 1e-5
    with open(tmp_path / "version_0" / "metrics.csv") as f:
        logged = [float(row["train/epoch_loss_rank0"]) for row in csv.DictReader(f) if row["train/epoch_loss_rank0"]]
    assert logged == [float(value) for _, value in printed]
