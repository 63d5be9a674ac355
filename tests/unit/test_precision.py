"""The precision fragments: each parses on top of the default config and trains a few real steps on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.command import main
from app.launch.preflight import PreflightError
from core.errors import error_line

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
    with pytest.raises(PreflightError) as exc:
        main([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)
    message = error_line(exc.value)
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


def test_bf16_true_evaluation_reports_the_fp32_loss(mnist_dir, tmp_path):
    """The same weights tested on MNIST's 10k test images: the loss averaged in bf16 stalled (3.03 against 2.30;
    bf16 arithmetic itself moves it by ~0.5%)."""
    from lightning.pytorch import Trainer, seed_everything

    from datamodules import MNISTDataModule
    from modules import ImageClassifier

    results = {}
    for precision in ("32-true", "bf16-true"):
        seed_everything(0)
        model = ImageClassifier(arch="mnist_fast")
        trainer = Trainer(
            accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        data = MNISTDataModule(data_dir=str(mnist_dir), batch_size=32, num_workers=0)
        results[precision] = trainer.test(model, data, verbose=False)[0]
        assert model.evaluated["test"] == (10000, 10000)
    assert results["bf16-true"]["test/loss"] == pytest.approx(results["32-true"]["test/loss"], rel=1e-2)


def test_fp16_true_with_adam_trains_and_says_it_raised_eps(mnist_dir, tmp_path):
    """Adam's eps=1e-8 is 0 in fp16: the weights were NaN after the first step. Raised to 1e-4, in one warning."""
    from lightning.pytorch import Callback

    class Losses(Callback):
        seen: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(float(outputs["loss"]))

    args = ["--config", str(CONFIGS / "fp16_true.yaml"), *FAST, "--data.data_dir", str(mnist_dir)]
    # LeNet: fp16 convolution backward on a CPU is slow for wider layers, and eps does not depend on the network
    args += ["--model.arch", "mnist_lenet", "--model.optimizer", "Adam", "--model.optimizer.init_args.lr", "0.001"]
    args += ["--trainer.limit_train_batches", "12"]  # Adam with its own lr (a class change keeps the recipe's 0.1)
    args += ["--data.batch_size", "64", "--trainer.default_root_dir", str(tmp_path)]
    cli = main(args, run=False)
    losses = Losses()
    cli.trainer.callbacks.append(losses)
    with pytest.warns(UserWarning, match=r"16-true: Adam eps=1e-08 is 0 in float16 .* eps=0.0001 is used"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())
    assert len(losses.seen) == 12 and all(map(torch.isfinite, torch.tensor(losses.seen)))
    assert sum(losses.seen[-3:]) / 3 < 0.8 * sum(losses.seen[:3]) / 3
    assert cli.model.optimizers().optimizer.param_groups[0]["eps"] == 1e-4


@pytest.mark.parametrize(
    ("capability", "expected"),
    [(None, "32-true"), ((7, 0), "16-mixed"), ((7, 5), "16-mixed"), ((8, 0), "bf16-mixed"), ((8, 6), "bf16-mixed"),
     ((9, 0), "bf16-mixed"), ((10, 0), "bf16-mixed")],
)  # fmt: skip
def test_precision_auto_takes_bf16_only_where_the_gpu_computes_it(capability, expected):
    """V100 (sm70) and T4 (sm75) emulate bf16 (``torch.cuda.is_bf16_supported()`` says True there): fp16 mixed;
    A100 (sm80) and newer: bf16 mixed; the reason is what the plan prints."""
    from core.device import precision_for, precision_reason

    assert precision_for(capability) == expected
    reason = precision_reason(capability)
    assert reason == "not on CUDA" if capability is None else ("emulates" in reason) == (expected == "16-mixed")


def test_deterministic_turns_benchmark_off_and_says_so(tmp_path, caplog):
    """configs/imagenet.yaml's ``benchmark: true`` under ``--trainer.deterministic true``: Lightning would keep it
    (and warn); the app's Trainer turns it off in one line, and leaves it alone otherwise."""
    from app.trainer import Trainer, resolve_benchmark

    common = {"accelerator": "cpu", "logger": False, "default_root_dir": tmp_path, "enable_progress_bar": False}
    for deterministic in (True, "warn"):
        assert resolve_benchmark(True, deterministic) is False
    trainer = Trainer(benchmark=True, deterministic=True, **common)
    assert torch.backends.cudnn.benchmark is False
    assert "trainer.benchmark off: trainer.deterministic is on" in caplog.text
    assert resolve_benchmark(True, None) is True and resolve_benchmark(True, False) is True
    assert resolve_benchmark(None, True) is None  # Lightning's own default under deterministic: off
    torch.use_deterministic_algorithms(False)  # (the Trainer set it for the whole process)
    del trainer


def test_the_imagenet_recipe_under_deterministic_resolves_benchmark_off(tmp_path, caplog):
    """The config path: configs/imagenet.yaml (benchmark: true) with --trainer.deterministic true."""
    recipe = Path(__file__).resolve().parents[2] / "configs" / "imagenet.yaml"
    args = ["--config", str(recipe), "--data.synthetic", "true", "--trainer.accelerator", "cpu", "--model.arch",
            "resnet18", "--trainer.deterministic", "true", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    try:
        cli = main(args, run=False)
        assert cli.trainer is not None and torch.backends.cudnn.benchmark is False  # (Lightning sets it from the flag)
        assert "trainer.benchmark off: trainer.deterministic is on" in caplog.text
    finally:
        torch.use_deterministic_algorithms(False)
