"""``--ckpt_path last`` resumes exactly: a run that crashes after its first epoch and is resumed ends with the same
parameters, bit for bit, as an uninterrupted run of the same length (model, optimizer, LR scheduler, epoch, step,
random generators). Single device in this process; ``ddp`` and ``allreduce`` in one 2-process gloo job (torchrun)
that runs the three legs of both modes in one process group, to keep process launches few.

The network is ``mnist_cnn``, which has dropout: its masks come from the torch generator, so a generator that is not
restored changes the weights. ``RNGProbe`` also makes every rank's generators different from the others' (each rank
draws a different number of values in the first epoch) and records them when the second epoch's first batch starts,
so the test sees that each rank got its own state back, not rank 0's and not a fresh seed.

Run as a module (``torchrun ... -m tests.distributed.test_resume OUT DATA``) it is that job.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback

from tests.conftest import short_fit
from tools.torchrun import run_torchrun_job

ROOT = Path(__file__).resolve().parents[2]
CRASH = "tests.distributed.test_resume.CrashAfterFirstEpoch"
PROBE = "tests.distributed.test_resume.RNGProbe"


class SimulatedCrash(RuntimeError):
    pass


class CrashAfterFirstEpoch(Callback):
    """Dies when the second epoch starts, i.e. after the first epoch's checkpoint was written (on every rank)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            raise SimulatedCrash("simulated crash after the first epoch")


def rng_digest() -> dict[str, str]:
    """A fingerprint of this process's torch, numpy and python random generators."""
    states = {"torch": torch.get_rng_state().numpy().tobytes(), "numpy": pickle.dumps(np.random.get_state()),
              "python": pickle.dumps(random.getstate())}  # fmt: skip
    return {name: hashlib.sha1(state).hexdigest()[:16] for name, state in states.items()}


class RNGProbe(Callback):
    """Rank R draws R + 1 values from each generator when the first epoch starts (the ranks' states then differ), and
    records the generators when the second epoch's first batch starts (in a resumed run: right after the restore);
    ``at_second_epoch`` is every rank's record, gathered when training ends."""

    def __init__(self) -> None:
        self.mine: dict[str, str] | None = None
        self.at_second_epoch: list[dict[str, str] | None] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            draws = trainer.global_rank + 1
            torch.rand(draws), np.random.rand(draws), [random.random() for _ in range(draws)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == 1 and batch_idx == 0:
            self.mine = rng_digest()

    def on_train_end(self, trainer, pl_module) -> None:
        import torch.distributed as dist

        self.at_second_epoch = [self.mine]
        if trainer.world_size > 1:
            self.at_second_epoch = [None] * trainer.world_size
            dist.all_gather_object(self.at_second_epoch, self.mine)


def _probe(cli) -> list[dict[str, str] | None]:
    (probe,) = [c for c in cli.trainer.callbacks if isinstance(c, RNGProbe)]
    return probe.at_second_epoch


def written(checkpoint: Path, timeout: float = 60) -> None:
    """Until ``checkpoint`` and its SHA-256 are on disk and agree. Rank 0 writes the epoch's checkpoint in the
    background and, on the crash, finishes it before its process goes on; the other ranks did not wait for it (a crash
    is no point where ranks meet), so in this one-process-per-rank harness they wait for the file itself."""
    from app.checkpoint import Checkpoints, recorded_checksum

    deadline = time.monotonic() + timeout
    while not (checkpoint.is_file() and recorded_checksum(checkpoint) and Checkpoints().reader.intact(checkpoint)):
        assert time.monotonic() < deadline, f"{checkpoint} not written within {timeout:g} s"
        time.sleep(0.1)


def common_args(root: Path, data_dir: str) -> list[str]:
    return [
        *short_fit(root, data_dir, 4, 2, epochs=2, batch_size=8),
        "--model.arch",
        "mnist_cnn",
        f"--trainer.callbacks+={PROBE}",
    ]


def three_legs(workdir: Path, data_dir: str, extra: list[str]) -> dict:
    """Uninterrupted run; crashed run; resumed run. Returns the max parameter difference and what was resumed."""
    from app.command import main

    full = main(["fit", *common_args(workdir / "full", data_dir), *extra])
    with pytest.raises(SimulatedCrash):
        main(["fit", *common_args(workdir / "crashed", data_dir), *extra, f"--trainer.callbacks+={CRASH}"])
    checkpoint = workdir / "crashed" / "version_0" / "checkpoints" / "last.ckpt"
    written(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    resumed = main(["fit", *common_args(workdir / "crashed", data_dir), *extra, "--ckpt_path", "last"])
    a, b = full.model.state_dict(), resumed.model.state_dict()
    return {
        "max_diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a),
        "moved_in_second_epoch": max(
            (resumed.model.state_dict()[k].float() - saved["state_dict"][k].float()).abs().max().item() for k in a
        ),
        "checkpoint_epoch": saved["epoch"],
        "checkpoint_step": saved["global_step"],
        "steps": [full.trainer.global_step, resumed.trainer.global_step],
        "epochs": [full.trainer.current_epoch, resumed.trainer.current_epoch],
        "lr": [full.trainer.optimizers[0].param_groups[0]["lr"], resumed.trainer.optimizers[0].param_groups[0]["lr"]],
        # per rank: the generators when the second epoch started, uninterrupted vs resumed; and what was saved
        "rng_full": _probe(full),
        "rng_resumed": _probe(resumed),
        "rng_saved_ranks": len(saved["callbacks"]["RNGState"]["ranks"]),
    }


def check(facts: dict, ranks: int) -> None:
    assert facts["checkpoint_epoch"] == 0 and facts["checkpoint_step"] == 4, facts  # the crash came after epoch 0
    assert facts["steps"] == [8, 8] and facts["epochs"] == [2, 2], facts
    assert facts["lr"][0] == facts["lr"][1], facts  # StepLR (per epoch) restored, not stepped twice
    assert facts["moved_in_second_epoch"] > 1e-3, facts  # the resumed run did train
    assert facts["max_diff"] == 0.0, f"resumed run differs from the uninterrupted one: {facts}"
    # every rank's generators, saved and restored: the resumed run's equal the uninterrupted run's, rank by rank
    assert facts["rng_saved_ranks"] == ranks, facts
    assert len(facts["rng_full"]) == ranks and None not in facts["rng_full"], facts
    assert facts["rng_resumed"] == facts["rng_full"], facts
    for name in ("torch", "numpy", "python"):  # and they differ between the ranks: rank 0's would not do for rank 1
        assert len({digest[name] for digest in facts["rng_full"]}) == ranks, (name, facts["rng_full"])


@pytest.mark.slow
def test_single_device_resume_is_exact(mnist_dir, tmp_path):
    check(three_legs(tmp_path, str(mnist_dir), []), ranks=1)


@pytest.fixture(scope="module")
def distributed_resume(mnist_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("resume")
    args = [str(out), str(mnist_dir)]
    return run_torchrun_job("tests.distributed.test_resume", args, 2, out / "results.json", "resume", timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "allreduce"])
def test_distributed_resume_is_exact(distributed_resume, strategy):
    check(distributed_resume[strategy], ranks=2)


def job(out: Path, data_dir: str) -> None:
    """One rank of the torchrun job: the three legs for each distributed mode; rank 0 writes the facts."""
    import torch.distributed as dist

    results = {}
    for strategy in ("ddp", "allreduce"):
        # a finite process-group timeout: a collective mismatch fails the test instead of hanging it
        extra = ["--trainer.strategy", strategy, "--trainer.devices", "2", "--launch.timeout", "120"]
        results[strategy] = three_legs(out / strategy, data_dir, extra)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    import gc

    # through the importable module, so SimulatedCrash is the class the CLI-instantiated callback raises
    from tests.distributed.test_resume import job as imported_job

    gc.freeze()  # as cli.py does: the imports' objects out of the cyclic collector's reach
    imported_job(Path(sys.argv[1]), sys.argv[2])
