"""The legs of a mid-epoch resume check, shared by ``tests/distributed/test_resume_anywhere.py`` and
``bench/resume_exact.py``: the uninterrupted run, the same run stopped by a real SIGTERM after a mid-epoch global step,
and its resume with ``--ckpt_path last``, each through the app's real CLI with the probe callbacks of
:mod:`tools.resume_probe` (the samples each rank trained on, the signal)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from tools.resume_probe import read_samples

ROOT = Path(__file__).resolve().parent.parent

PROBE, SIGNAL = "tools.resume_probe.SampleLog", "tools.resume_probe.SignalAt"
STOP = 9  # 2 epochs x 6 batches: global step 9 is epoch 1, batch 3


EPOCH_VALUES = ("train/loss_epoch", "train/acc1_epoch", "train/acc5_epoch")


def mnist_args(root: Path, data_dir: str, workers: int) -> list[str]:
    """MNIST without workers: the resident path (a batch is one indexing); with workers: the DataLoader's path."""
    return [
        # the per-step LinearLR recipe: a run raised past its first length (--trainer.max_steps) resumes its schedule
        "--config", str(ROOT / "configs" / "mnist_2epochs.yaml"),
        "--data.data_dir", data_dir, "--data.batch_size", "8", "--data.num_workers", str(workers),
        "--data.resident", "false" if workers else "true",
        "--model.arch", "mnist_cnn",  # dropout: the generators' states matter
    ]  # fmt: skip


# the modern recipe at the tests' size: its augmentations, mixing, repeated augmentation (x4) and moving average, the
# average restarted through a 1-epoch warm-up, then updated every 2 steps with a decay of 0.7 (torchvision's rule)
MODERN = [
    "--data.eval_image_size", "32", "--data.eval_resize_size", "36", "--model.warmup_epochs", "1",
    "--ema.torchvision_decay", "0.9", "--ema.update_every_n_steps", "2",
]  # fmt: skip


def imagenet_args(root: Path, photos: str, workers: int, recipe: str = "imagenet.yaml") -> list[str]:
    """The ImageNet recipe (or ``recipe``: ``imagenet_modern.yaml`` with :data:`MODERN`) on the test photos: resnet18
    at 32 px, 3 images per device."""
    return [
        "--config", f"configs/{recipe}", "--data.data_dir", photos, "--model.arch", "resnet18",
        "--data.image_size", "32", "--data.batch_size", "3", "--data.num_workers", str(workers),
        "--trainer.devices", "1", "--model.optimizer.init_args.lr", "0.01",
        *(MODERN if recipe != "imagenet.yaml" else []),
    ]  # fmt: skip


def fit(root: Path, data: list[str], extra: list[str], batches: int = 6):
    from app.command import main

    return main([
        "fit", *data, "--trainer.default_root_dir", str(root), "--seed_everything", "7", "--trainer.max_epochs", "2",
        "--trainer.limit_train_batches", str(batches), "--trainer.limit_val_batches", "1",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        f"--trainer.callbacks+={PROBE}", f"--trainer.callbacks.folder={root}", *extra,
    ])  # fmt: skip


def max_diff(a: dict, b: dict, keys: set[str] | None = None) -> float:
    """The largest difference between two state dicts (only ``keys`` when given)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if keys is None or k in keys)


def legs(workdir: Path, data: list[str], extra: list[str], ranks: int, stop: int = STOP, batches: int = 6) -> dict:
    """Uninterrupted, stopped by SIGTERM (rank 0 signals itself), resumed: what a user would compare.

    ``batches`` per epoch (2 epochs); the stop after global step ``stop``."""
    # The earlier legs' trainers sit in reference cycles with their models and datasets; the collector's own schedule
    # (it counts objects, not bytes) let a job of 8 scenarios grow each rank past 5 GB.
    gc.collect()
    full = fit(workdir / "full", data, extra, batches)
    code = None
    try:
        signal = [f"--trainer.callbacks+={SIGNAL}", f"--trainer.callbacks.step={stop}"]
        fit(workdir / "stopped", data, [*extra, *signal], batches)
    except SystemExit as stop_exit:
        code = stop_exit.code
    last = workdir / "stopped" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    kept = workdir / "stopped.ckpt"  # the resumed run replaces last.ckpt
    kept.write_bytes(last.read_bytes())
    resumed = fit(workdir / "stopped", data, [*extra, "--ckpt_path", "last"], batches)
    ends = [torch.load(newest_last(workdir / leg), weights_only=True) for leg in ("full", "stopped")]
    averaged = "current_model_state" in ends[0]  # a moving average: the model ends with it, last.ckpt has both
    weights = {name for name, _ in full.model.named_parameters()}  # the state dicts' other entries are buffers
    samples = {}
    for rank in range(ranks):
        a, b = read_samples(workdir / "full", rank), read_samples(workdir / "stopped", rank)
        samples[rank] = {
            "same": [(x["epoch"], x["batch"], x["samples"]) for x in a]
            == [(x["epoch"], x["batch"], x["samples"]) for x in b],
            "trained": len(a),
            "recorded": len(b),
            # the interrupted epoch: each of its samples exactly once in the stopped + resumed runs
            "epoch1_repeats": (lambda s: len(s) - len(set(s)))([d for x in b if x["epoch"] == 1 for d in x["samples"]]),
        }  # fmt: skip
    return {
        "exit": code,
        "saved_step": saved["global_step"],
        "saved_epoch": saved["epoch"],
        "loader_state": saved["loops"]["fit_loop"]["state_dict"].get("combined_loader"),
        "steps": [full.trainer.global_step, resumed.trainer.global_step],
        "max_diff": max_diff(full.model.state_dict(), resumed.model.state_dict()),
        "max_diff_weights": max_diff(full.model.state_dict(), resumed.model.state_dict(), weights),
        # with a moving average the weights a run ends with are the average; its training weights are in last.ckpt
        "max_diff_training": max_diff(*(end["current_model_state"] for end in ends)) if averaged else None,
        "max_diff_training_weights": max_diff(*(e["current_model_state"] for e in ends), weights) if averaged else None,
        "average_vs_training": max_diff(ends[0]["state_dict"], ends[0]["current_model_state"], weights)
        if averaged
        else None,
        # the last epoch's training values (the interrupted epoch, in check's scenarios), as logged
        "epoch_values": [
            {k: float(run.trainer.callback_metrics[k]) for k in EPOCH_VALUES if k in run.trainer.callback_metrics}
            for run in (full, resumed)
        ],
        "samples": samples,
        "stopped_ckpt": str(kept),
    }


def newest_last(root: Path) -> Path:
    """The newest ``last.ckpt`` of a run folder (a resumed run writes into its own version)."""
    return max(root.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)


def trail(folder: Path, rank: int = 0) -> list[tuple]:
    return [(x["epoch"], x["batch"], x["samples"]) for x in read_samples(folder, rank)]


def scenarios() -> dict[str, tuple[list[str], int]]:
    """The 2-process scenarios, name -> (strategy arguments, loader workers): every multi-process mode the registry
    declares (``declared_modes``) without workers, and the reference ``ddp`` with 2 (the loader and its workers are
    the same code under every mode). On CPU ``ddp_mp``'s stages are all the CPU: its DDP-over-stages path;
    ``allreduce_fp16``/``bf16`` round on the wire, the same way again after the resume."""
    # imported here, not above: bench.resume_exact --app binds ``app`` to another checkout before it asks
    import app.strategies  # noqa: F401  (registers the app's strategy names)
    from app.strategies.modes import REFERENCE, declared_modes
    from core.layout import layout_of

    modes = [m for m in declared_modes() if not layout_of(m).one_process]
    return {
        **{f"{mode}_w0": (["--trainer.strategy", mode], 0) for mode in modes},
        f"{REFERENCE}_w2": (["--trainer.strategy", REFERENCE], 2),
    }
