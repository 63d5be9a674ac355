"""A user's run: ``python cli.py fit`` with the allreduce fragment on 2 CPU processes (Lightning's own launcher).

One job checks what the README promises of ``allreduce`` with ``overlap: true`` and ``compression: bf16`` (the
``allreduce_bf16`` variant, here with overlap and small buckets so that several buckets exist):

- overlap is on: every bucket whose gradients are all ready is all-reduced from the gradient hooks while backward
  still runs, before the closure ends;
- the gradients travel in bf16: after the average, every gradient is exactly a bf16 number;
- a parameter with a gradient on rank 0 only is averaged (rank 1 sends zeros) and one with no gradient on any rank
  stays without one and unchanged: no hang, both ranks finish, identical weights;
- BatchNorm running statistics differ between the ranks after training and are their average, equal on every rank,
  when validation starts;
- the model learns (validation accuracy after 30 steps of 2 x 32 images).

The checks run in the job's processes (``Probe``, given with ``--trainer.callbacks+=``), which write what they saw to
``<default_root_dir>/probe/rank<R>.pt``; this test compares the ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from tests.conftest import run_cli

PROBE = "tests.distributed.test_strategies_cli.Probe"


class RankDependentNet(nn.Module):
    """The configured network plus ``rank0_bias`` (added to the logits on rank 0 only) and ``unused`` (never used)."""

    def __init__(self, net: nn.Module, rank: int) -> None:
        super().__init__()
        self.rank0_bias = nn.Parameter(torch.zeros(10))
        self.unused = nn.Parameter(torch.ones(3))
        self.net, self.rank = net, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits + self.rank0_bias if self.rank == 0 else logits


def _bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if "running_" in k}


class Probe(Callback):
    """Records, on each rank, what the strategy did (see the module docstring)."""

    def __init__(self) -> None:
        self.facts: dict = {"launched_in_backward": [], "buckets": None, "not_bf16": 0, "grads_checked": 0}
        self._pending_pre_sync = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # before the strategy broadcasts rank 0's weights and builds its buckets
            pl_module.net = RankDependentNet(pl_module.net, trainer.global_rank)

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        self.facts["buckets"] = len(strategy._buckets)
        self.facts["overlap"], self.facts["compression"] = strategy.overlap, strategy.compression
        average = strategy.average_gradients

        def counted() -> None:  # runs when backward ends: the buckets the gradient hooks launched during it
            self.facts["launched_in_backward"].append(strategy._next)
            average()

        strategy.average_gradients = counted

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # after the average
        net = pl_module.net
        for name, param in net.named_parameters():
            if param.grad is None:
                self.facts.setdefault("no_grad", set()).add(name)
                continue
            self.facts["grads_checked"] += 1
            self.facts["not_bf16"] += int(not torch.equal(param.grad, param.grad.bfloat16().float()))
        self.facts.setdefault("rank0_bias_grads", []).append(net.rank0_bias.grad.clone())

    def on_validation_start(self, trainer, pl_module) -> None:  # callbacks run before the strategy's hook
        if not trainer.sanity_checking:
            self._pending_pre_sync = _bn_stats(pl_module)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self._pending_pre_sync is not None and batch_idx == 0:
            self.facts.setdefault("bn", []).append((self._pending_pre_sync, _bn_stats(pl_module)))
            self._pending_pre_sync = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.facts["params"] = {k: v.detach().clone() for k, v in pl_module.net.named_parameters()}
        folder = Path(trainer.default_root_dir) / "probe"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.facts, folder / f"rank{trainer.global_rank}.pt")


@pytest.fixture(scope="module")
def allreduce_job(mnist_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("allreduce")
    result = run_cli(
        "fit", "--config", "configs/strategy/allreduce.yaml", "--trainer.strategy.init_args.overlap", "true",
        "--trainer.strategy.init_args.compression", "bf16", "--trainer.strategy.init_args.bucket_cap_mb", "0.01",
        "--launch.timeout", "60", f"--trainer.callbacks+={PROBE}", "--model.arch", "mnist_fast",  # BatchNorm
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "30", "--trainer.limit_val_batches", "5", "--data.batch_size", "32",
        "--trainer.enable_progress_bar", "false",
        "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(root), timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    facts = [torch.load(root / "probe" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return root, result, facts


@pytest.mark.distributed
@pytest.mark.slow
def test_allreduce_bf16_with_overlap_trains_mnist_through_the_cli(allreduce_job):
    root, result, facts = allreduce_job
    assert "AllReduceStrategy" in result.stdout + result.stderr
    (best,) = [p for p in (root / "version_0" / "checkpoints").glob("epoch=*.ckpt")]
    accuracy = float(re.search(r"val_acc1=([0-9.]+)\.ckpt", best.name).group(1))
    assert accuracy > 0.8, f"30 steps x 64 images should pass 80% on MNIST validation, got {accuracy}"
    assert (root / "version_0" / "checkpoints" / "last.ckpt").is_file()
    for rank in facts:
        assert rank["overlap"] is True and rank["compression"] == "bf16"
        assert len(rank["launched_in_backward"]) == 30  # every step's backward was seen
        # the wrapper's own parameters come first, so they sit in the last bucket, which `unused` never completes;
        # every other bucket was all-reduced from the hooks during backward
        assert rank["buckets"] > 2 and rank["launched_in_backward"] == [rank["buckets"] - 1] * 30, rank
        # every averaged gradient went through bf16 on the wire
        assert rank["grads_checked"] > 30 * 10 and rank["not_bf16"] == 0, rank


@pytest.mark.distributed
@pytest.mark.slow
def test_allreduce_rank_dependent_and_unused_parameters_do_not_hang(allreduce_job):
    _, _, (rank0, rank1) = allreduce_job
    assert rank0["no_grad"] == rank1["no_grad"] == {"unused"}  # stays without a gradient, as under DDP
    assert torch.equal(rank0["params"]["unused"], torch.ones(3))
    assert torch.equal(rank1["params"]["unused"], torch.ones(3))
    # rank 0's gradient of rank0_bias, averaged with rank 1's zeros, is the same on both ranks
    for g0, g1 in zip(rank0["rank0_bias_grads"], rank1["rank0_bias_grads"], strict=True):
        assert torch.equal(g0, g1)
    assert max(g.abs().max().item() for g in rank0["rank0_bias_grads"]) > 1e-4
    assert rank0["params"].keys() == rank1["params"].keys()
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), f"{name} differs between the ranks"
    assert rank0["params"]["rank0_bias"].abs().max().item() > 1e-4  # it was trained


@pytest.mark.distributed
@pytest.mark.slow
def test_allreduce_batchnorm_statistics_are_averaged_before_validation(allreduce_job):
    _, _, (rank0, rank1) = allreduce_job
    ((before0, after0),) = rank0["bn"]  # one validation after training (the sanity check is not counted)
    ((before1, after1),) = rank1["bn"]
    assert before0.keys() == after0.keys() and len(before0) >= 4, before0.keys()
    differed = 0
    for key in before0:
        if "num_batches_tracked" in key:
            continue
        differed += int(not torch.equal(before0[key], before1[key]))  # each rank normalised its own shard
        assert torch.equal(after0[key], after1[key]), key
        torch.testing.assert_close(after0[key], (before0[key] + before1[key]) / 2, rtol=1e-6, atol=1e-7)
    assert differed >= 2, "the ranks' BatchNorm statistics were equal before the sync: the check proves nothing"
