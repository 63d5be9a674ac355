"""A user's own Lightning script uses the app's strategies as the docs say: ``import app.strategies`` registers the
names (``allreduce``, ``dp``, ``ddp_mp`` ...) in Lightning's StrategyRegistry; ``import app`` alone registers none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
{imports}
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

trainer = Trainer(
    strategy="allreduce", accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(BoringModel())
print("trained", type(trainer.strategy).__name__, trainer.global_step)
"""


def user_script(imports: str, tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT.format(imports=imports))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the package installed, the script in the user's own folder
    command = [sys.executable, "train.py"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_import_app_strategies_registers_the_names(tmp_path):
    run = user_script("import app.strategies  # noqa: F401", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained AllReduceStrategy 3" in run.stdout


def test_import_app_alone_registers_nothing(tmp_path):
    run = user_script("import app  # noqa: F401", tmp_path)
    assert run.returncode != 0, run.stdout
    assert "invalid strategy name" in run.stderr.lower() and "allreduce" in run.stderr, run.stderr[-3000:]
