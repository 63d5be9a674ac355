"""CLI parsing: every config file parses and instantiates; links; overrides; the run layout."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger

from app.command import main
from app.launch.preflight import PreflightError
from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.wandb_reader import requires_wandb

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FRAGMENTS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent != CONFIGS)
TOP_LEVEL = sorted(CONFIGS.glob("*.yaml"))


def instantiate(*args: str, tmp_path: Path):
    return main([*args, "--trainer.default_root_dir", str(tmp_path)], run=False)


def test_defaults_are_mnist(tmp_path):
    cli = instantiate(tmp_path=tmp_path)
    assert isinstance(cli.model, ImageClassifier) and isinstance(cli.datamodule, MNISTDataModule)
    assert cli.model.hparams.arch == "mnist_lenet"
    # linked from the datamodule, never typed twice
    assert (cli.model.hparams.num_classes, cli.model.hparams.in_channels) == (10, 1)
    # the logger writes into the run folder
    assert isinstance(cli.trainer.logger, TensorBoardLogger)
    assert Path(cli.trainer.logger.save_dir) == tmp_path


@pytest.mark.parametrize("config", TOP_LEVEL, ids=lambda p: p.name)
def test_top_level_configs_parse(config, tmp_path):
    args = ("--config", str(config))
    fp16 = (yaml.safe_load(config.read_text()).get("trainer") or {}).get("precision") == "16-mixed"
    if fp16 and not torch.cuda.is_available():  # parsed, then refused by the preflight; the rest is checked in fp32
        with pytest.raises(PreflightError, match="16-mixed .* needs a CUDA GPU"):
            instantiate(*args, tmp_path=tmp_path)
        args += ("--trainer.precision", "32-true")
    cli = instantiate(*args, tmp_path=tmp_path)
    assert cli.model.hparams.num_classes == cli.datamodule.num_classes


@pytest.mark.parametrize(
    "fragment",
    [pytest.param(f, marks=requires_wandb) if f.stem == "wandb" else f for f in FRAGMENTS],
    ids=lambda p: str(p.relative_to(CONFIGS)),
)
def test_fragments_stack_on_the_default(fragment, tmp_path):
    args = ("--config", str(CONFIGS / "mnist.yaml"), "--config", str(fragment))
    if fragment.stem == "fp16_mixed" and not torch.cuda.is_available():  # parsed, then refused by the preflight
        with pytest.raises(PreflightError, match="16-mixed .* needs a CUDA GPU"):
            instantiate(*args, tmp_path=tmp_path)
        return
    cli = instantiate(*args, tmp_path=tmp_path)
    trainer = yaml.safe_load(fragment.read_text())["trainer"]  # what the fragment sets is what the Trainer got
    if "precision" in trainer:
        assert cli.trainer.precision == trainer["precision"]
    if "strategy" in trainer:
        strategy = trainer["strategy"]
        expected = "DataParallelStrategy" if strategy == "dp" else strategy["class_path"].rsplit(".", 1)[1]
        assert type(cli.trainer.strategy).__name__ == expected
        if isinstance(strategy, dict) and "timeout" in strategy["init_args"]:
            assert cli.trainer.strategy._timeout == timedelta(minutes=30)
    if "logger" in trainer:
        loggers = trainer["logger"] if isinstance(trainer["logger"], list) else [trainer["logger"]]
        names = [lg["class_path"].rsplit(".", 1)[1] for lg in loggers]
        assert [type(lg).__name__ for lg in cli.trainer.loggers] == names


def test_command_line_overrides_and_optimizer_injection(tmp_path):
    cli = instantiate(
        "--model.arch", "resnet18", "--model.optimizer", "SGD", "--model.optimizer.lr", "0.05",
        "--model.optimizer.momentum", "0.9", "--data.batch_size", "32",
        "--model.lr_scheduler.init_args.total_steps", "100",  # no Trainer here to tell OneCycleLR the run's length
        tmp_path=tmp_path,
    )  # fmt: skip
    configured = cli.model.configure_optimizers()
    optimizer = configured["optimizer"]
    assert configured["lr_scheduler"]["scheduler"].total_steps == 100
    assert type(optimizer).__name__ == "SGD" and optimizer.defaults["lr"] == 0.05
    assert optimizer.defaults["momentum"] == 0.9
    assert cli.model.net.conv1.in_channels == 1 and cli.datamodule.batch_size == 32


def test_unknown_arch_fails_with_the_list(tmp_path):
    with pytest.raises(ValueError, match="Unknown model.arch 'lenet9'.*resnet50"):
        instantiate("--model.arch", "lenet9", tmp_path=tmp_path)


def test_typo_in_a_key_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        instantiate("--trainer.max_epoch", "3", tmp_path=tmp_path)
    assert exit_info.value.code != 0
    assert "max_epoch" in capsys.readouterr().err


def test_logging_off_still_trains_with_the_default_callbacks(mnist_dir, tmp_path):
    """``--trainer.logger false`` is a valid choice: the default LR monitor must not stop the run."""
    cli = main(
        ["fit", "--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
         "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1", "--data.data_dir", str(mnist_dir),
         "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
         "--model.lr_scheduler", "null"]  # a constant lr: the second run trains on past the first one's length
    )  # fmt: skip
    assert cli.trainer.global_step == 3 and not cli.trainer.loggers
    last = tmp_path / "checkpoints" / "last.ckpt"  # no logger: no version_N folder
    assert list(tmp_path.rglob("last.ckpt")) == [last]
    # --ckpt_path last finds it (it used to look only in version_*/ and silently start from scratch)
    cli = main(
        ["fit", "--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "2",
         "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1", "--data.data_dir", str(mnist_dir),
         "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
         "--model.lr_scheduler", "null", "--ckpt_path", "last"]
    )  # fmt: skip
    assert cli.trainer.ckpt_path == str(last) and cli.trainer.global_step == 6
