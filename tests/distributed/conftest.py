"""One 2-process gloo job (torchrun, CPU) shared by the distributed tests: a job costs ~10-20 s of imports per
process here, so it checks the collectives and every mode on three scenarios at once (see ``app.parity``)."""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback

from app.parity import compare, table

STEPS = 6  # optimizer steps per mode; with 3 batches per epoch the runs cross an epoch boundary
SGD = ["--model.optimizer", "SGD", "--model.optimizer.lr", "0.05", "--model.optimizer.momentum", "0.9"]
EXACT_MODES = ["ddp", "allreduce", "allreduce_per_param", "allreduce_overlap", "ddp_mp"]


AMP_MODES = ["ddp", "allreduce", "allreduce_per_param", "allreduce_overlap"]


class OverflowOnRank1(Callback):
    """Rank 1 alone gets an all-inf batch at the third step: its fp16 gradients are inf/NaN, rank 0's are finite."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            batch[0].fill_(float("inf"))


class HalveGradientsAfterBackward(Callback):
    """Edits every gradient in on_after_backward (as gradient scaling or clipping code does), on every rank."""

    def on_after_backward(self, trainer, pl_module) -> None:
        for param in pl_module.parameters():
            if param.grad is not None:
                param.grad.mul_(0.5)


def scenarios(data_dir: str) -> list[dict]:
    # mnist_cnn: no BatchNorm, so every mode must equal one device exactly (the default mnist_fast has BatchNorm)
    common = ["--data.data_dir", str(data_dir), "--data.batch_size", "8", "--model.arch", "mnist_cnn", *SGD]
    return [
        {  # the MNIST example's network (no BatchNorm); plus the wire-compressed all-reduce
            "name": "plain",
            "args": [*common, "--trainer.limit_train_batches", "3"],
            "modes": [*EXACT_MODES, "allreduce_fp16"],
        },
        {  # 2 micro-batches per optimizer step: 4 batches per epoch = 2 steps per epoch
            "name": "accumulate",
            "args": [*common, "--trainer.limit_train_batches", "4", "--trainer.accumulate_grad_batches", "2"],
            "modes": EXACT_MODES,
        },
        {  # BatchNorm, per-rank statistics (DDP without SyncBatchNorm)
            "name": "batchnorm",
            "args": [*common, "--model.arch", "resnet18", "--trainer.limit_train_batches", "3"],
            "modes": EXACT_MODES,
        },
        {  # gradients edited in on_after_backward: every mode must apply the edit (allreduce_overlap dropped it)
            "name": "grad_edits",
            "args": [*common, "--trainer.limit_train_batches", "3"],
            "modes": AMP_MODES,
            "callbacks": ["tests.distributed.conftest:HalveGradientsAfterBackward"],
        },
        {  # fp16 with a GradScaler: an overflow on one rank must make every rank skip the same step
            "name": "amp",
            "args": [*common, "--trainer.limit_train_batches", "3"],
            "modes": AMP_MODES,
            "fp16_scaler": True,
            "callbacks": ["tests.distributed.conftest:OverflowOnRank1"],
        },
    ]


@pytest.fixture(scope="session")
def parity(mnist_dir, tmp_path_factory) -> dict:
    """The job's facts per scenario and mode, with the max parameter difference against single device and ddp."""
    workdir = tmp_path_factory.mktemp("parity")
    results = compare(scenarios(mnist_dir), steps=STEPS, nproc=2, workdir=workdir, accelerator="cpu")
    print(f"\nparity job ({STEPS} steps, 2 gloo processes)\n{table(results)}")  # the figures, with pytest -s
    return results
