"""A rank slowed on purpose is named as the slowest, in the logger and in the training summary (2 gloo processes)."""

from __future__ import annotations

import json
import time

import pytest
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import run_cli

pytestmark = pytest.mark.xdist_group("timing")  # its pass depends on wall-clock limits: never beside another such test

SLOW_S = 0.05  # rank 1's extra time per step


class SlowRank1(Callback):
    """Rank 1 spends SLOW_S more of its own time in each step (before the step's first collective)."""

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_rank == 1:
            time.sleep(SLOW_S)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_slowed_rank_is_named_in_the_logger_and_the_summary(mnist_dir, tmp_path):
    fit = run_cli(
        "fit", "--trainer.default_root_dir", str(tmp_path), "--data.data_dir", str(mnist_dir),
        "--data.batch_size", "16", "--trainer.strategy", "ddp", "--trainer.devices", "2",
        "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "4",
        "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks+=tests.distributed.test_stragglers.SlowRank1",
    )  # fmt: skip
    out = fit.stdout + fit.stderr
    assert fit.returncode == 0, out[-4000:]
    lines = out.splitlines()
    verdicts = [i for i, line in enumerate(lines) if "is the slowest" in line]
    assert len(verdicts) == 1 and out.count("Training summary") == 1, out[-3000:]  # one block, printed once
    verdict, block = lines[verdicts[0]], lines[lines.index("Training summary") : verdicts[0] + 2]
    assert verdict.startswith("rank 1 (host ") and "x the median step" in verdict, verdict
    # the table is the summary's last block: its rows follow the summary's figures, a rule closes it
    assert any(line.startswith("world size") for line in block) and set(block[-1]) == {"-"}, "\n".join(block)
    ranks = json.loads((tmp_path / "version_0" / "summary.json").read_text())["per rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["step_ms"] > ranks[0]["step_ms"], ranks
    # the wait for data (MNIST resident: one indexing per batch) and Lightning's loop, each a share of the step
    assert all(0 <= r["data_wait_frac"] < 0.5 and 0 < r["loop_frac"] < 1 and r["whole_step_ms"] > 0 for r in ranks)
    assert any(line.startswith("waiting for data") for line in block), "\n".join(block)
    assert any(line.startswith("Lightning's loop between steps") for line in block), "\n".join(block)
    events = EventAccumulator(str(tmp_path / "version_0")).Reload()
    slowest = [p.value for p in events.Scalars("perf/slowest_rank")]
    assert slowest and set(slowest) == {1.0}, slowest
    rank0 = [p.value for p in events.Scalars("perf/rank_step_time_ms/rank0")]
    rank1 = [p.value for p in events.Scalars("perf/rank_step_time_ms/rank1")]
    assert all(b - a > 0.6 * SLOW_S * 1000 for a, b in zip(rank0, rank1, strict=True)), (rank0, rank1)
    skew = [p.value for p in events.Scalars("perf/step_time_skew")]
    assert all(s > 1.2 for s in skew) and events.Scalars("perf/data_wait_frac"), skew
