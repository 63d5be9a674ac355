"""``--launch.debug true``: the ranks' disagreements that hang DDP jobs are named (2 gloo processes)."""

from __future__ import annotations

import re

import pytest
from lightning.pytorch import Callback

from app.callbacks.debug_checks import apply_debug
from tests.conftest import run_cli


class FewerBatchesOnRank1(Callback):
    """Rank 1 gets one batch less per epoch than rank 0 (a sampler bug, as users meet it)."""

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 1:
            trainer.limit_train_batches = 3


class MetricOnRank1(Callback):
    """Rank 1 alone logs a metric."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_rank == 1:
            pl_module.log("debug/rank1_only", 1.0)


def fit(root, mnist_dir, callback: str):
    return run_cli(
        "fit", "--trainer.default_root_dir", str(root), "--data.data_dir", str(mnist_dir), "--data.batch_size", "16",
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1",
        "--trainer.log_every_n_steps", "2", "--trainer.enable_progress_bar", "false", "--launch.debug", "true",
        f"--trainer.callbacks+=tests.distributed.test_debug_checks.{callback}",
    )  # fmt: skip


def test_debug_sets_torch_and_nccl_checks_with_a_log_file_per_process(tmp_path):
    environ = {"NCCL_DEBUG": "WARN"}  # the user's own value stays
    made = apply_debug(tmp_path / "debug", environ)
    assert made == {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_CPP_LOG_LEVEL": "INFO",
        "NCCL_DEBUG_FILE": str(tmp_path / "debug" / "nccl.%h.%p.log"),
    }
    assert environ["NCCL_DEBUG"] == "WARN" and (tmp_path / "debug").is_dir()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("callback", "said"),
    [
        ("FewerBatchesOnRank1", "different numbers of training batches in epoch 0 (rank 0: 4, rank 1: 3)"),
        ("MetricOnRank1", "different metric keys by step 2 (rank 0 lacks "),
    ],
)
def test_a_disagreement_between_ranks_is_named(mnist_dir, tmp_path, callback, said):
    run = fit(tmp_path / "run", mnist_dir, callback)
    out = run.stdout + run.stderr
    lines = [line for line in out.splitlines() if line.startswith("error: --launch.debug:")]
    assert run.returncode == 1 and lines and said in lines[0], out[-4000:]
    assert "--launch.debug: TORCH_DISTRIBUTED_DEBUG=DETAIL " in out and "hang timeout 120 s" in out
    # DETAIL on gloo: DDP was built (torch's segfault avoided, see debug_checks), each rank's c10d lines in its file
    where = [line for line in out.splitlines() if "rank<R>.log" in line]
    assert len(where) == 1 and str(tmp_path / "run" / "debug" / "rank<R>.log") in where[0], out[-4000:]
    assert "Running collective" not in out and "DDP Initialized with" not in out, out[-4000:]  # not on the terminal
    for rank in (0, 1):
        text = (tmp_path / "run" / "debug" / f"rank{rank}.log").read_text()
        tags = set(re.findall(r"\[rank(\d+)\]:", text))
        assert tags == {str(rank)}, (rank, tags, text[-2000:])  # this rank's lines, no other's
        assert "Using backend config" in text, text[-2000:]  # c10d's Python logger
    rank1 = (tmp_path / "run" / "debug" / "rank1.log").read_text()  # a rank Lightning started: C++ INFO lines too
    assert "ProcessGroupWrapper" in rank1 and "[Rank 1]: DDP Initialized with" in rank1, rank1[-2000:]
    if callback == "MetricOnRank1":
        assert "debug/rank1_only" in lines[0], lines
