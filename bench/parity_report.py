"""The parity figures the README quotes: ``python -m bench.parity_report`` (about 3 minutes on 2 CPU cores).

The CI's parity job (``tests/distributed/test_parity.py``) with the same scenarios, written to
``results/parity.{json,md}``: 2 gloo processes on CPU, real MNIST, 8 images per rank, 6 SGD-with-momentum steps
crossing an epoch boundary; per mode, the largest parameter difference against one device that sees each whole
global batch (``tools.parity``), and against ``ddp``; the default network (``mnist_fast``, BatchNorm) with and without
``--trainer.sync_batchnorm true``, 5 steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from app.strategies.modes import REFERENCE, declared_modes, parity_modes
from bench.common import RESULTS, machine, machine_line, write_json

STEPS = 6  # optimizer steps per mode; with 3 batches per epoch the runs cross an epoch boundary
SYNCBN_STEPS = 5  # the SyncBatchNorm scenarios (also across an epoch boundary)
# The SyncBatchNorm comparison runs in float64: in fp32 this tiny-batch MNIST run amplifies last-bit differences
# (a max-pool or ReLU choice between nearly equal values flips) to ~1e-3 in 5 steps, even between two single-device
# runs whose BatchNorm differs only in memory layout; in float64 the algorithm itself is compared.
FP64 = ["--trainer.precision", "64-true"]
# the previous MNIST recipe (per-step warm-up and linear decay), which the committed parity results were measured with;
# the default recipe's OneCycleLR would set the lr itself (max_lr) and start it 25x lower
# (given before the data arguments: they need its data.class_path)
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ["--config", str(ROOT / "configs" / "mnist_2epochs.yaml")]
SGD = ["--model.optimizer", "SGD", "--model.optimizer.lr", "0.05", "--model.optimizer.momentum", "0.9"]
# the registry's modes, by what their layouts claim (core.layout): exact vs one device in fp32, close (fp16
# on the wire), and the fp16 GradScaler scenario
EXACT_MODES = parity_modes("exact")
CLOSE_MODES = parity_modes("close")
AMP_MODES = parity_modes("exact", fp16=True)
MODERN_MODES = [m for m in EXACT_MODES if m in declared_modes(variants=False)]  # one per strategy class


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


# the modern ImageNet recipe on the test photos: resnet18 at 32 px, 3 images per rank, its repeated augmentation (x4),
# TrivialAugment, random erasing, mixup/cutmix per device's share, weight decay groups, a 1-epoch warm-up and a
# moving average updated every step (torchvision's rule, decay 0.95 per image-epoch: 0.7 per update here); float64 with
# SyncBatchNorm (see FP64), so that every mode must equal the one device on the average and on the training weights
MODERN = [
    "--model.arch", "resnet18", "--data.image_size", "32", "--data.batch_size", "3", "--data.num_workers", "0",
    "--trainer.limit_train_batches", "3", "--trainer.sync_batchnorm", "true", *FP64, "--model.warmup_epochs", "1",
    "--model.optimizer.init_args.lr", "20", "--ema.torchvision_decay", "0.95", "--ema.update_every_n_steps", "1",
]  # fmt: skip


def scenarios(data_dir: str, photos: str | None = None) -> list[dict]:
    """The parity job's scenarios on MNIST in ``data_dir``; with ``photos`` (``tools.photos``), the modern recipe's."""
    # mnist_cnn: no BatchNorm, so every mode must equal one device exactly (mnist_fast has BatchNorm)
    common = [*RECIPE, "--data.data_dir", str(data_dir), "--data.batch_size", "8", "--model.arch", "mnist_cnn", *SGD]
    fast = [*common, "--model.arch", "mnist_fast", "--trainer.limit_train_batches", "3"]
    modern = [
        {  # the modern ImageNet recipe (configs/imagenet_modern.yaml) on real photos: mixing per device's share
            "name": "modern",
            "args": ["--config", str(ROOT / "configs" / "imagenet_modern.yaml"), "--data.data_dir", photos, *MODERN],
            "modes": MODERN_MODES,
        }
    ]
    return [
        *(modern if photos else []),
        {  # the MNIST example's network (no BatchNorm); plus the wire-compressed all-reduce
            "name": "plain",
            "args": [*common, "--trainer.limit_train_batches", "3"],
            "modes": [*EXACT_MODES, *CLOSE_MODES],
        },
        {  # 2 micro-batches per optimizer step: 4 batches per epoch = 2 steps per epoch
            "name": "accumulate",
            "args": [*common, "--trainer.limit_train_batches", "4", "--trainer.accumulate_grad_batches", "2"],
            "modes": EXACT_MODES,
        },
        {  # BatchNorm, per-rank statistics (DDP without SyncBatchNorm): mnist_fast (ResNet-18: the modern scenario)
            "name": "batchnorm",
            "args": [*fast],
            "modes": EXACT_MODES,
        },
        {  # SyncBatchNorm: the default network (BatchNorm) normalised by the global batch on every rank = one device
            "name": "syncbn",
            "args": [*fast, *FP64, "--trainer.sync_batchnorm", "true"],
            "modes": EXACT_MODES,
            "steps": SYNCBN_STEPS,
        },
        {  # the same run without it: each rank normalises by its own 8 images, so ddp drifts from one device
            "name": "syncbn_off",
            "args": [*fast, *FP64],
            "modes": [REFERENCE],
            "steps": SYNCBN_STEPS,
        },
        {  # SyncBatchNorm in fp32: rounding differences, amplified by this run (see FP64)
            "name": "syncbn_fp32",
            "args": [*fast, "--trainer.sync_batchnorm", "true"],
            "modes": [REFERENCE],
            "steps": SYNCBN_STEPS,
        },
        {  # gradients edited in on_after_backward: every mode must apply the edit (allreduce_overlap dropped it)
            "name": "grad_edits",
            "args": [*common, "--trainer.limit_train_batches", "3"],
            "modes": AMP_MODES,
            "callbacks": ["bench.parity_report:HalveGradientsAfterBackward"],
        },
        {  # torch.compile (Inductor) under ddp and allreduce against the eager single device: the compiled step keeps
            # parity; the compile caches shared by both ranks and modes (the run folder's, as in training)
            "name": "compiled",
            "args": [*common, "--trainer.limit_train_batches", "3", "--model.compile", "true"],
            "reference": ["--model.compile", "false"],
            "modes": [REFERENCE, "allreduce"],
        },
        {  # fp16 with a GradScaler: an overflow on one rank must make every rank skip the same step. LeNet: torch's
            # fp16 convolution backward on a CPU is slow for the CNN's 32- and 64-channel layers (498 ms a step
            # against LeNet's 38 ms, batch 8), and the skip decision does not depend on the network
            "name": "amp",
            "args": [*common, "--trainer.limit_train_batches", "3", "--model.arch", "mnist_lenet"],
            "modes": AMP_MODES,
            "fp16_scaler": True,
            "callbacks": ["bench.parity_report:OverflowOnRank1"],
        },
    ]


def markdown(results: dict[str, Any]) -> str:
    from tools.parity import table

    command = results.get("command", "python -m bench.parity_report").strip()
    return "\n".join(
        [
            "# Parity: every mode against one device",
            "",
            f"Machine: {machine_line(results['machine'])}. Command: `{command}` (the scenarios of "
            f"`tests/distributed/test_parity.py`: 2 gloo processes, 8 MNIST images per rank, {STEPS} SGD steps; "
            f"the SyncBatchNorm scenarios {SYNCBN_STEPS}; the modern recipe's: 3 photos per rank, {STEPS} steps).",
            "",
            "```",
            table(results),
            "```",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from datamodules.mnist import ensure_mnist
    from tools.parity import compare
    from tools.photos import build_photo_imagenet

    parser = argparse.ArgumentParser(prog="python -m bench.parity_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="data", help="MNIST folder (fetched if missing)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for parity.{json,md}")
    parser.add_argument("--scenarios", default="", help="only these (comma-separated), into parity_<names>.{json,md}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    only = [n for n in args.scenarios.split(",") if n]
    stem = "parity" + "".join(f"_{n}" for n in only)
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        photos = str(build_photo_imagenet(Path(tmp) / "photos"))
        chosen = [s for s in scenarios(str(ensure_mnist(args.data_dir)), photos) if not only or s["name"] in only]
        results = compare(chosen, STEPS, 2, Path(tmp), accelerator="cpu")
    results["machine"] = machine()
    results["command"] = "python -m bench.parity_report " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(args.out / f"{stem}.json", results)
    (args.out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
