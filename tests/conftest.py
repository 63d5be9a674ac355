"""Shared fixtures: real MNIST (fetched once into the repo's data/ cache), the CLI runner, RunIf-style skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MNIST_DATA_DIR", ROOT / "data"))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """A folder with the four real MNIST files, fetched through the app's own code path if missing."""
    from datamodules.mnist import ensure_mnist

    return ensure_mnist(DATA_DIR)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Runs ``python cli.py ARGS`` as a user would, returning the CompletedProcess (output captured as text)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fast_trainer(tmp_path, **kwargs):
    """A real Trainer on CPU for a few batches, without logger, checkpoints or progress bar (override any argument)."""
    from lightning.pytorch import Trainer

    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=2, limit_test_batches=2,
        limit_predict_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


def requires_cuda(n: int = 1):
    """Skip with a readable reason unless ``n`` CUDA devices exist."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA device(s), found {have}")
