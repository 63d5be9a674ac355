"""Configs that state only what differs, as a user runs them: the base config and one recipe, the ``--checkpoint``
group, the ``--callbacks.NAME`` switches, the two ways to turn a default off (``--trainer.logger CLASS`` without
``save_dir``, ``--trainer.enable_checkpointing false``), a run's saved ``config.yaml`` from an earlier version, and the
first screen of the default run in its default (relative) run folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from app.callbacks import DEFAULTS, Throughput
from app.command import main
from modules import ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
SAVED_CONFIG = ROOT / "tests" / "fixtures" / "config_2026-12-01.yaml"  # written by `cli.py fit` at commit 6fa2fb8
SHORT = [
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
    "--trainer.limit_test_batches", "1",
    "--trainer.log_every_n_steps", "1",
]  # fmt: skip


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python cli.py ARGS`` in ``cwd``, stdout and stderr in one stream in the order a terminal shows them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(ROOT / "cli.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def counts(callbacks: list[Callback]) -> dict[str, int]:
    names = [type(cb).__name__ for cb in callbacks]
    return {name: names.count(name) for name in names}


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_the_default_run_in_its_relative_run_folder(mnist_dir, tmp_path):
    """`cli.py fit` then `cli.py test --ckpt_path last` with the default run folder (runs/mnist, relative)."""
    (tmp_path / "data").symlink_to(mnist_dir)
    fit = cli("fit", *SHORT, cwd=tmp_path)
    assert fit.returncode == 0, fit.stdout[-3000:]
    assert (tmp_path / "runs" / "mnist" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    # the last epoch's progress bar is finished before the training summary, not drawn below it
    bar, summary = fit.stdout.rfind("Epoch 0/0"), fit.stdout.find("Training summary")
    assert -1 < bar < summary, fit.stdout[-3000:]
    test = cli("test", "--ckpt_path", "last", "--trainer.limit_test_batches", "1", cwd=tmp_path)
    assert test.returncode == 0, test.stdout[-3000:]
    assert "test/acc1" in test.stdout
    assert "dirpath has changed" not in test.stdout, test.stdout[-3000:]


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_defaults_turned_off_with_one_flag_each(mnist_dir, tmp_path):
    """`--trainer.logger lightning.pytorch.loggers.CSVLogger` without save_dir writes into the run folder (its
    version_N layout); `--trainer.enable_checkpointing false` trains without writing a checkpoint."""
    run = cli(
        "fit", *SHORT, "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(tmp_path / "run"),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    assert "Training summary" in run.stdout and "Traceback" not in run.stdout
    version = tmp_path / "run" / "version_0"
    assert "val/acc1" in (version / "metrics.csv").read_text().splitlines()[0]
    assert (version / "config.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written next to it (lightning_logs/ ...)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_checkpoint_group_and_callback_switches(mnist_dir, tmp_path):
    cli_ = main(
        ["--trainer.default_root_dir", str(tmp_path), "--data.data_dir", str(mnist_dir),
         "--checkpoint.save_top_k", "3", "--checkpoint.every_n_train_steps", "1000", "--callbacks.throughput", "false",
         "--trainer.callbacks+=app.callbacks.AMPHealth", "--trainer.callbacks.max_nonfinite_steps", "7"],
        run=False,
    )  # fmt: skip
    callbacks = cli_.trainer.callbacks
    (checkpoint,) = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
    assert (checkpoint.save_top_k, checkpoint._every_n_train_steps, checkpoint.monitor) == (3, 1000, "val/acc1")
    assert not any(isinstance(cb, Throughput) for cb in callbacks)  # switched off
    amp = [cb for cb in callbacks if type(cb).__name__ == "AMPHealth"]
    assert len(amp) == 1 and amp[0].max_nonfinite_steps == 7  # the one in trainer.callbacks replaced the default
    others = set(DEFAULTS) - {"throughput", "amp_health"}
    assert {DEFAULTS[name].__name__ for name in others} <= set(counts(callbacks))


def test_recipes_state_only_what_differs(tmp_path):
    """The ImageNet recipe does not inherit MNIST's recipe (it used to undo warmup_epochs and channels_last)."""
    base = yaml.safe_load((ROOT / "configs" / "base.yaml").read_text())
    assert "model" not in base and "data" not in base  # machinery only
    for recipe in ("imagenet", "imagenet_apex", "tutorial_mnist", "mnist_pytorch_example"):
        text = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text())
        assert text["model"].get("warmup_epochs") != 0.0 and text["model"].get("channels_last") is not False, recipe
    cli_ = main(["--config", str(ROOT / "configs" / "imagenet.yaml"), "--data.synthetic", "true",
                 "--trainer.default_root_dir", str(tmp_path), "--trainer.devices", "1"], run=False)  # fmt: skip
    hparams = cli_.model.hparams
    assert (hparams.arch, hparams.warmup_epochs, hparams.channels_last) == ("resnet50", 0.0, "auto")  # on CUDA only


def test_a_saved_config_of_an_earlier_version_keeps_loading(mnist_dir, tmp_path):
    """`cli.py fit --config <a run's config.yaml>` as the version before this layout wrote it (its nine callbacks in
    trainer.callbacks, no --callbacks or --checkpoint groups): it trains, with its own callbacks once each."""
    cli_ = main(
        ["fit", "--config", str(SAVED_CONFIG), *SHORT, "--data.data_dir", str(mnist_dir),
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.enable_progress_bar", "false"],
    )  # fmt: skip
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert isinstance(cli_.model, ImageClassifier) and cli_.model.hparams.arch == "mnist_fast"
    assert cli_.model.hparams.warmup_epochs == 0.2 and cli_.model.hparams.channels_last is True
    found = counts(cli_.trainer.callbacks)
    for name in [cls.__name__ for cls in DEFAULTS.values()] + ["ModelCheckpoint"]:
        assert found.get(name) == 1, (name, found)  # its own list, not the defaults on top of it
    assert not isinstance(cli_.trainer.logger, CSVLogger)
    (checkpoint,) = [cb for cb in cli_.trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert (checkpoint.monitor, checkpoint.save_top_k) == ("val/acc1", 1)
