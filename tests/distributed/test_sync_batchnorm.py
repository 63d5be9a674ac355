"""``CPUSyncBatchNorm``'s synchronised forward and backward, on real gloo groups of 1 and 2 processes, compute what
BatchNorm computes on the concatenated batch: output, input gradient, running statistics (unbiased global variance),
and parameter gradients once the ranks' local ones are summed (as DDP does, up to its 1/world average). The shards
have different sizes (3 and 5 images).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from app.sync_batchnorm import CPUSyncBatchNorm
from modules.zoo.mnist_fast import mnist_fast
from tests.conftest import run_cli
from tests.distributed.two_ranks import two_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real gloo groups of 2 processes; the CLI fits below
SHARDS = {1: [8], 2: [3, 5]}  # images per rank
CHANNELS, TOL = 4, 1e-9  # float64: the formulas, not rounding, are compared


def _data(momentum: float | None) -> tuple[nn.BatchNorm2d, torch.Tensor, torch.Tensor]:
    """A BatchNorm layer with non-trivial affine parameters and statistics, a batch and an upstream gradient."""
    gen = torch.Generator().manual_seed(0)
    bn = nn.BatchNorm2d(CHANNELS, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(torch.rand(CHANNELS, generator=gen, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(CHANNELS, generator=gen, dtype=torch.float64))
        bn.running_mean.copy_(torch.randn(CHANNELS, generator=gen, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(CHANNELS, generator=gen, dtype=torch.float64) + 0.5)
    x = torch.randn(8, CHANNELS, 5, 5, generator=gen, dtype=torch.float64) * 3 + 1
    dy = torch.randn(8, CHANNELS, 5, 5, generator=gen, dtype=torch.float64)
    return bn, x, dy


class _AlwaysSynced(CPUSyncBatchNorm):
    """Takes the synchronised path in a group of 1 too (the layer itself is plain BatchNorm there, as torch's is)."""

    def _world(self) -> int:
        return 2


def _step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, steps: int = 2) -> dict[str, torch.Tensor]:
    """Forward and backward ``steps`` times (the running statistics move twice), then the last results."""
    for _ in range(steps):
        layer.zero_grad()
        x = x.detach().requires_grad_()
        y = layer(x)
        y.backward(dy)
    return {
        "y": y.detach(),
        "grad_input": x.grad,
        "grad_weight": layer.weight.grad,
        "grad_bias": layer.bias.grad,
        **{k: v.clone() for k, v in layer.state_dict().items()},
    }


def _run(world: int, momentum: float | None, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """Each rank's step on its shard, in a real gloo group of ``world`` processes (2: this one and a fork of it)."""

    def step_on_shard(rank: int) -> dict[str, torch.Tensor]:
        bn, x, dy = _data(momentum)
        layer = (_AlwaysSynced if world == 1 else CPUSyncBatchNorm).convert(bn)
        start = sum(SHARDS[world][:rank])
        shard = slice(start, start + SHARDS[world][rank])
        return _step(layer, x[shard], dy[shard])

    if world == 2:
        return two_ranks(step_on_shard, tmp_path)
    if dist.is_initialized():  # a one-process group an earlier in-process fit left
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        return [step_on_shard(0)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [0.1, None])  # None: cumulative moving average
@pytest.mark.parametrize("world", [1, 2])
def test_matches_batchnorm_on_the_concatenated_batch(world, momentum, tmp_path):
    ranks = _run(world, momentum, tmp_path)
    bn, x, dy = _data(momentum)
    expected = _step(bn, x, dy)
    for key in ("y", "grad_input"):  # each rank holds its own shard's rows
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), expected[key], atol=TOL, rtol=0)
    for key in ("grad_weight", "grad_bias"):  # local sums; DDP adds them up over the ranks
        torch.testing.assert_close(sum(r[key] for r in ranks), expected[key], atol=TOL, rtol=0)
    for rank in ranks:  # every rank tracks the global batch's statistics, the unbiased variance like torch
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(rank[key], expected[key], atol=TOL, rtol=0)
        assert set(rank) - {"y", "grad_input", "grad_weight", "grad_bias"} == set(bn.state_dict())


def test_per_rank_batchnorm_would_differ(tmp_path):
    """The comparison above can fail: BatchNorm on rank 1's shard alone gives other outputs and statistics."""
    bn, x, dy = _data(0.1)
    alone, expected = _step(bn, x[3:], dy[3:]), _step(_data(0.1)[0], x, dy)
    assert (alone["y"] - expected["y"][3:]).abs().max() > 1e-2
    assert (alone["running_var"] - expected["running_var"]).abs().max() > 1e-2


class SyncedDuringFit(Callback):
    """Stops the run unless every BatchNorm layer is the CPU SyncBatchNorm while it trains, and synchronises: after
    each batch every rank's running statistics are those of the global batch, the same on both ranks (the ranks'
    shards differ, so per-rank statistics would differ; neither strategy syncs buffers between steps' forwards)."""

    def on_train_start(self, trainer, pl_module) -> None:
        kinds = {type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)}
        if kinds != {"CPUSyncBatchNorm"}:
            raise RuntimeError(f"BatchNorm layers are {kinds} during fit, not CPUSyncBatchNorm")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = torch.cat([m.running_mean for m in pl_module.modules() if isinstance(m, _BatchNorm)])
        every = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
        dist.all_gather(every, stats)
        if not all(torch.allclose(s, every[0], rtol=0, atol=1e-6) for s in every):
            raise RuntimeError(f"batch {batch_idx}: the ranks' BatchNorm running means differ (not synchronised)")


@pytest.mark.parametrize("strategy", ["ddp", "allreduce"])
def test_the_flag_trains_on_cpu_processes(strategy, mnist_dir, tmp_path):
    """``python cli.py fit --trainer.sync_batchnorm true`` on 2 CPU processes: torch's SyncBatchNorm used to stop it
    ("SyncBatchNorm layers only work with GPU modules"); its checkpoint loads into the plain network."""
    root = tmp_path / "run"
    result = run_cli(
        "fit", "--trainer.strategy", strategy, "--trainer.sync_batchnorm", "true", "--trainer.accelerator", "cpu",
        "--model.arch", "mnist_fast",  # BatchNorm layers to convert
        "--trainer.devices", "2", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
        "--trainer.limit_val_batches", "2", "--data.batch_size", "16", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks+=tests.distributed.test_sync_batchnorm.SyncedDuringFit", "--launch.timeout", "120",
        "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(root), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (last,) = root.glob("version_*/checkpoints/last.ckpt")
    state = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    mnist_fast().load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")})
