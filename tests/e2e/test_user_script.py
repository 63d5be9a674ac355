"""A user's own Lightning script uses the app's strategies as the docs say: ``import app.strategies`` registers the
names (``allreduce``, ``dp``, ``ddp_mp`` ...) in Lightning's StrategyRegistry; ``import app`` alone registers none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import app  # registers nothing
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

settings = dict(
    accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
try:
    Trainer(strategy="allreduce", **settings)
except Exception as err:
    print("import app:", type(err).__name__, str(err).splitlines()[0])

import app.strategies  # noqa: F401  (what the docs say registers the names)

trainer = Trainer(strategy="allreduce", **settings)
trainer.fit(BoringModel())
print("import app.strategies: trained", type(trainer.strategy).__name__, trainer.global_step)
"""


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_import_app_strategies_registers_the_names(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the package installed, the script in the user's own folder
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("import app:") and "invalid strategy name" in line.lower() for line in lines), lines
    assert "import app.strategies: trained AllReduceStrategy 3" in lines, run.stdout
