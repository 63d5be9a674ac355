"""The per-step agreement (``app.resilience.agree``) on 2 real gloo processes of a real Trainer (``ddp_spawn``).

A flag raised on rank 1 alone when a batch starts is seen by both ranks when that batch ends, and only then: the
flag of a signal already acted on is not seen again one step later (what requeued the SLURM job twice). Two watchers
of the same run (SIGTERMCheckpoint and SLURMRequeue both are) share one reduction per batch, started by the first.

The same job gives rank 1 short last batches (3 images of 8), so the ranks hold unequal numbers of images: the
classifier's ``train/loss_epoch`` must then be the mean over every image of both ranks (its one all-reduce of sums),
which differs from the mean of the two ranks' own means (all ``log_dict(sync_dist=True)`` alone would give).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from app.resilience import agree
from datamodules.mnist import load_split
from modules import ImageClassifier

RAISED_AT = 3  # the batch at whose start rank 1 raises its flag
BATCHES = 6
SHORT, SHORTENED = 3, 3  # rank 1's last SHORTENED batches keep SHORT images each


class Watcher(Callback):
    """Watches ``name``: rank ``raiser`` raises it at batch ``RAISED_AT``'s start and lowers it once acted on (as
    SIGTERMCheckpoint does); every rank records the agreed answer of each batch into ``out``."""

    def __init__(self, name: str, out: Path, raiser: int = 1) -> None:
        self.name, self.out, self.raiser = name, out, raiser
        self.raised = False
        self.answers: list[bool] = []

    def on_train_start(self, trainer, pl_module):
        agree.watch(trainer, self.name, lambda: self.raised)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.raiser and batch_idx == RAISED_AT:
            self.raised = True
        agree.start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        answer = agree.any_rank(trainer, self.name)
        self.answers.append(answer)
        if answer:
            self.raised = False  # acted on

    def on_train_end(self, trainer, pl_module):
        agree.unwatch(trainer, self.name)
        path = self.out / f"{self.name}.rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"answers": self.answers, "pending": agree.agreement(trainer).pending is not None}))


class ShortLastBatchOnRank1(Callback):
    """Rank 1's last ``SHORTENED`` batches keep their first ``SHORT`` images (a rank whose shard ends early); every
    rank records each batch's loss and images into ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[tuple[float, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx >= BATCHES - SHORTENED:
            batch[0], batch[1] = batch[0][:SHORT], batch[1][:SHORT]  # the very list training_step receives

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((float(outputs["loss"]), len(batch[1])))

    def on_train_end(self, trainer, pl_module):
        (self.out / f"steps.rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.fixture(scope="module")
def job(mnist_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The 2-process run; returns its folder (each rank's records) and the metrics rank 0 ended with."""
    out = tmp_path_factory.mktemp("agree")
    images, labels = load_split(mnist_dir, train=True)
    loader = DataLoader(TensorDataset(images[: 2 * 8 * BATCHES], labels[: 2 * 8 * BATCHES]), batch_size=8)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, limit_val_batches=0,
        callbacks=[Watcher("sigterm", out), Watcher("requeue", out), ShortLastBatchOnRank1(out)],
    )  # fmt: skip
    seed_everything(0)  # the same initial weights every run: the ranks' losses, so the gap below, are reproducible
    model = ImageClassifier(
        arch="mnist_cnn", num_classes=10, in_channels=1, optimizer=partial(torch.optim.SGD, lr=0.01)
    )
    trainer.fit(model, train_dataloaders=loader)  # (ddp_spawn pickles the model: a partial, not the default lambda)
    return out, {k: float(v) for k, v in trainer.callback_metrics.items()}  # (ddp_spawn returns rank 0's)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_flag_of_one_rank_is_seen_by_all_at_the_end_of_that_batch_and_only_then(job):
    tmp_path, _ = job
    # "sigterm" was raised before its batch's reduction started (by the first watcher's start); "requeue" after it,
    # so the next batch's reduction carries it: exactly as a signal arriving during a step is acted on a step later
    for name, at in (("sigterm", RAISED_AT), ("requeue", RAISED_AT + 1)):
        for rank in (0, 1):
            seen = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            # rank 0 never raised it: it knows from the agreement alone, at the same batch as rank 1, and once
            assert seen["answers"] == [batch == at for batch in range(BATCHES)], (name, rank, seen)
            assert not seen["pending"], "a reduction was left running after the last watcher stopped"


@pytest.mark.slow
@pytest.mark.distributed
def test_the_epoch_loss_is_over_every_image_of_both_ranks_with_unequal_batches(job):
    out, metrics = job
    ranks = [json.loads((out / f"steps.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [n for _, n in ranks[1]] == [8] * (BATCHES - SHORTENED) + [SHORT] * SHORTENED
    assert [n for _, n in ranks[0]] == [8] * BATCHES
    over_images = sum(loss * n for steps in ranks for loss, n in steps) / sum(n for steps in ranks for _, n in steps)
    rank_means = [sum(loss * n for loss, n in steps) / sum(n for _, n in steps) for steps in ranks]
    assert abs(over_images - sum(rank_means) / 2) > 1e-4  # the test can tell them apart
    assert metrics["train/loss_epoch"] == pytest.approx(over_images, rel=1e-5)


def test_one_process_reads_the_flags_at_the_end_of_the_batch(mnist_dir, tmp_path):
    """Without a process group there is nothing to reduce: the answer is the flag as the batch ends."""
    images, labels = load_split(mnist_dir, train=True)
    loader = DataLoader(TensorDataset(images[: 8 * BATCHES], labels[: 8 * BATCHES]), batch_size=8)
    watcher = Watcher("sigterm", tmp_path, raiser=0)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
        callbacks=[watcher],
    )  # fmt: skip
    trainer.fit(ImageClassifier(arch="mnist_cnn", num_classes=10, in_channels=1), train_dataloaders=loader)
    assert watcher.answers == [batch == RAISED_AT for batch in range(BATCHES)]
    assert agree.agreement(trainer).sources == {}  # unwatched at the end
