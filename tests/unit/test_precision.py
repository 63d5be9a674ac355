"""The precision fragments: each parses on top of the default config and trains a few real steps on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "precision"
FAST = [
    "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
    "--trainer.limit_val_batches", "1", "--data.batch_size", "4", "--trainer.enable_progress_bar", "false",
    "--trainer.num_sanity_val_steps", "0",
]  # fmt: skip
# fragment -> (Lightning precision string on CPU, dtype of the trained weights)
EXPECTED = {
    "fp32": ("32-true", torch.float32),
    "bf16_mixed": ("bf16-mixed", torch.float32),
    "bf16_true": ("bf16-true", torch.bfloat16),
    "fp16_true": ("16-true", torch.float16),
    "fp16_mixed": ("bf16-mixed", torch.float32),  # no fp16 AMP on CPU: Lightning says so and uses bf16
}


def test_every_fragment_is_covered():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("fragment", sorted(EXPECTED))
def test_fragment_trains_on_cpu(fragment, mnist_dir, tmp_path):
    args = ["--config", str(CONFIGS / f"{fragment}.yaml"), *FAST, "--data.data_dir", str(mnist_dir)]
    if fragment == "fp16_mixed":
        with pytest.warns(UserWarning, match=r"AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`"):
            cli = main([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)
    else:
        cli = main([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)
    precision, dtype = EXPECTED[fragment]
    assert cli.trainer.precision == precision
    before = [p.detach().clone() for p in cli.model.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    params = list(cli.model.parameters())
    assert all(p.dtype == dtype for p in params)
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, b.to(a.dtype)) for a, b in zip(before, params, strict=True))
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
