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
}
# fp16_mixed needs CUDA: on the CPU the preflight stops it (test_fp16_mixed_on_cpu_stops_with_the_fix)


def test_every_fragment_is_covered():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted([*EXPECTED, "fp16_mixed"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp16_mixed_on_cpu_stops_with_the_fix(mnist_dir, tmp_path, capsys):
    args = ["--config", str(CONFIGS / "fp16_mixed.yaml"), *FAST, "--data.data_dir", str(mnist_dir)]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)
    message = str(exc.value.code) + capsys.readouterr().err
    assert "16-mixed" in message and "needs a CUDA GPU" in message and "--trainer.precision bf16-mixed" in message


@pytest.mark.parametrize("fragment", sorted(EXPECTED))
def test_fragment_trains_on_cpu(fragment, mnist_dir, tmp_path):
    args = ["--config", str(CONFIGS / f"{fragment}.yaml"), *FAST, "--data.data_dir", str(mnist_dir)]
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
