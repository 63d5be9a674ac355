"""What only two ranks can tell, each checked by a real 2-process DDP fit (gloo, CPU) in this process and a fork of it
(``tests.distributed.two_ranks``: about a second per fit, so `make mutation` runs it for every mutant):

- the classifier's epoch values are over every image of both ranks when rank 1's last batches are short (one
  all-reduce of sums; the mean of the ranks' means differs);
- the per-step agreement: a flag raised on rank 1 alone is seen by both ranks at the end of that batch, once
  (``tests/distributed/test_agree.py`` checks the same on ``ddp_spawn``, in ~17 s), and a watch that begins during a
  batch is answered False there and from the next batch's reduction on;
- AMPHealth stops every rank at the step where one rank reached the limit of non-finite losses (any rank, not all).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from app.callbacks import AMPHealth, NonFiniteLossError
from app.resilience import agree
from datamodules.mnist import load_split
from modules import ImageClassifier
from tests.distributed.test_agree import BATCHES, RAISED_AT, SHORT, SHORTENED, ShortLastBatchOnRank1, Watcher
from tests.distributed.two_ranks import two_ranks

pytestmark = pytest.mark.distributed
NAN_FROM, LIMIT = 1, 2  # rank 1's losses are NaN from this batch on; AMPHealth stops at this many in a row
LATE = 2  # the batch at whose end LateWatcher starts watching


class ThisRank(LightningEnvironment):
    """The rank this process already is (two_ranks made the group): Lightning starts no process of its own."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._local = rank

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def local_rank(self) -> int:
        return self._local


class NaNOnRank1(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx >= NAN_FROM:
            batch[0].fill_(float("nan"))


class Hits(Callback):
    """Each step's top-1 and top-5 hits of this rank's batch (from the logged per-step accuracies)."""

    def __init__(self) -> None:
        self.hits: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        n = len(batch[1])
        metrics = trainer.callback_metrics
        self.hits.append((round(float(metrics["train/acc1"]) * n), round(float(metrics["train/acc5"]) * n)))


def _trainer(rank: int, out: Path, callbacks: list[Callback]) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=2, strategy="ddp", plugins=[ThisRank(rank)], max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        limit_val_batches=0, log_every_n_steps=1, callbacks=callbacks,
    )  # fmt: skip


def _fit(trainer: Trainer, mnist: Path) -> None:
    """The job of test_agree: 6 batches of 8 per rank (DistributedSampler), the same initial weights every run."""
    images, labels = load_split(mnist, train=True)
    loader = DataLoader(TensorDataset(images[: 2 * 8 * BATCHES], labels[: 2 * 8 * BATCHES]), batch_size=8)
    seed_everything(0)
    model = ImageClassifier(arch="mnist_cnn", optimizer=partial(torch.optim.SGD, lr=0.01))
    trainer.fit(model, train_dataloaders=loader)


def _epoch_values(rank: int, mnist: Path, out: Path) -> dict:
    short, hits = ShortLastBatchOnRank1(out), Hits()
    trainer = _trainer(rank, out, [short, hits])
    _fit(trainer, mnist)
    epoch = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("_epoch")}
    return {"steps": short.steps, "hits": hits.hits, "epoch": epoch}


def test_the_epoch_values_are_over_every_image_of_both_ranks(mnist_dir, tmp_path):
    ranks = two_ranks(partial(_epoch_values, mnist=mnist_dir, out=tmp_path), tmp_path)
    assert [n for _, n in ranks[1]["steps"]] == [8] * (BATCHES - SHORTENED) + [SHORT] * SHORTENED
    steps = [step for rank in ranks for step in rank["steps"]]
    images = sum(n for _, n in steps)
    over_images = sum(loss * n for loss, n in steps) / images
    rank_means = [sum(loss * n for loss, n in r["steps"]) / sum(n for _, n in r["steps"]) for r in ranks]
    assert abs(over_images - sum(rank_means) / 2) > 1e-4  # the test can tell them apart
    hits = [h for rank in ranks for h in rank["hits"]]
    for rank in ranks:  # the same values on both ranks
        assert rank["epoch"]["train/loss_epoch"] == pytest.approx(over_images, rel=1e-6)
        assert rank["epoch"]["train/acc1_epoch"] == pytest.approx(sum(h[0] for h in hits) / images, rel=1e-6)
        assert rank["epoch"]["train/acc5_epoch"] == pytest.approx(sum(h[1] for h in hits) / images, rel=1e-6)


class LateWatcher(Callback):
    """The only watcher, and it starts watching at the end of batch ``LATE``: until then no reduction runs, and the
    flag (true on rank 1) is not known at that batch's end; the next batch's reduction carries it."""

    def __init__(self) -> None:
        self.answers: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        agree.start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == LATE:
            agree.watch(trainer, "late", lambda: trainer.global_rank == 1)
        self.answers.append(agree.any_rank(trainer, "late"))

    def on_train_end(self, trainer, pl_module):
        agree.unwatch(trainer, "late")


def _answers(rank: int, out: Path, mnist: Path) -> dict:
    watchers = [Watcher("sigterm", out), Watcher("requeue", out)]
    trainer = _trainer(rank, out, watchers)
    _fit(trainer, mnist)
    late = LateWatcher()
    _fit(_trainer(rank, out, [late]), mnist)
    return {
        "answers": {w.name: w.answers for w in watchers},
        "pending": agree.agreement(trainer).pending,
        "late": late.answers,
    }


def test_a_flag_of_rank_1_is_seen_by_both_ranks_at_the_end_of_that_batch_only(mnist_dir, tmp_path):
    ranks = two_ranks(partial(_answers, mnist=mnist_dir, out=tmp_path), tmp_path)
    # "sigterm" is raised before its batch's reduction starts, "requeue" after it (the next batch's carries it)
    for name, at in (("sigterm", RAISED_AT), ("requeue", RAISED_AT + 1)):
        for rank, facts in enumerate(ranks):
            assert facts["answers"][name] == [batch == at for batch in range(BATCHES)], (name, rank, facts)
    assert all(facts["pending"] is None for facts in ranks)  # no reduction left running after the last watcher
    for facts in ranks:  # False (not None) while nothing is watched or agreed yet, True once a batch carried it
        assert facts["late"] == [False] * (LATE + 1) + [True] * (BATCHES - LATE - 1), facts["late"]


def _stop(rank: int, mnist: Path, out: Path) -> dict:
    trainer = _trainer(rank, out, [NaNOnRank1(), AMPHealth(max_nonfinite_steps=LIMIT)])
    try:
        _fit(trainer, mnist)
    except NonFiniteLossError as err:
        return {"stop": str(err), "step": trainer.global_step}
    return {"stop": None, "step": trainer.global_step}


def test_one_rank_s_nonfinite_losses_stop_every_rank_at_that_step(mnist_dir, tmp_path):
    """Rank 1's losses are NaN from batch 1 on; rank 0's only from batch 2 (the averaged NaN gradient reaches its
    weights one step later): stopping when *any* rank reached the limit is one step earlier than when all did."""
    ranks = two_ranks(partial(_stop, mnist=mnist_dir, out=tmp_path), tmp_path)
    for rank, facts in enumerate(ranks):
        assert facts["stop"] is not None, f"rank {rank} did not stop"
        assert facts["step"] == NAN_FROM + LIMIT, (rank, facts)
    assert f"not finite for {LIMIT} consecutive steps (steps {NAN_FROM + 1}..{NAN_FROM + LIMIT}" in ranks[1]["stop"]
