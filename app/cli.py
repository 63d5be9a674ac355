"""The command line: LightningCLI with the project's defaults, links and run-directory conventions.

Run layout: ``<trainer.default_root_dir>/version_N/`` holds the TensorBoard events, ``config.yaml`` (the resolved
config) and ``checkpoints/`` (``last.ckpt`` plus the best by ``val/acc1``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import app  # noqa: F401  (registers the strategy names before the parser reads them)
from app.callbacks import StopAtAccuracy
from app.launch.plan import apply_timeout, preflight, rendezvous_errors_explained
from app.loggers import TrackingConfigCallback, prepare_loggers
from modules import ImageClassifier

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "mnist.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def find_last_checkpoint(root_dir: str | Path) -> Path | None:
    """The newest ``version_*/checkpoints/last.ckpt`` below ``root_dir``, or None."""
    found = sorted(Path(root_dir).glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


class CLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return LightningCLI.subcommands()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The datamodule knows its classes and channels; the model is told, never configured twice.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.in_channels", "model.in_channels", apply_on="instantiate")
        # Always present (a no-op without a target) and set with `--stop_at_accuracy.target 75` or a YAML fragment:
        # an entry of trainer.callbacks could only be configured by restating the whole list.
        parser.add_lightning_class_args(StopAtAccuracy, "stop_at_accuracy")
        parser.add_argument(
            "--launch.timeout",
            type=float | None,
            default=None,
            help="Seconds the ranks wait for each other at start-up and in collectives before failing with a message "
            "naming who is missing (default: the strategy's own, 1800 s for ddp).",
        )

    def _subcommand_config(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        self._loggers_write_to_run_dir()
        self._resolve_last_checkpoint()
        prepare_loggers(self._subcommand_config(), self.subcommand)  # W&B group; resumed run's identity
        # launcher vs config, before any process group exists; rank 0 prints the plan, every rank stops on a problem
        preflight(self._subcommand_config(), timeout=self._subcommand_config().launch.timeout)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        apply_timeout(self.trainer.strategy, self._subcommand_config().launch.timeout)

    def _logger_configs(self) -> list:
        loggers = self._subcommand_config().trainer.get("logger")
        loggers = loggers if isinstance(loggers, list) else [loggers]
        return [lg for lg in loggers if hasattr(lg, "init_args")]

    def _loggers_write_to_run_dir(self) -> None:
        """A logger configured without ``save_dir`` writes into ``trainer.default_root_dir``: one folder to set."""
        root = self._subcommand_config().trainer.default_root_dir or "."
        for logger in self._logger_configs():
            if "save_dir" in logger.init_args and logger.init_args.save_dir is None:
                logger.init_args.save_dir = root

    def _resolve_last_checkpoint(self) -> None:
        """``--ckpt_path last`` means the newest run's ``last.ckpt`` in this experiment's folder.

        Lightning resolves "last" only among the current ModelCheckpoint's folder, which is a new ``version_N`` for
        every run, so it would never find the previous run. We resolve it here and let the logger continue that
        run's version, so a resumed run keeps writing to the same TensorBoard version and run folder.
        """
        config = self._subcommand_config()
        if config.get("ckpt_path") != "last":
            return
        root = config.trainer.default_root_dir or "."
        last = find_last_checkpoint(root)
        if last is None:
            if self.subcommand == "fit":
                rank_zero_info(
                    f"--ckpt_path last: no {root}/version_*/checkpoints/last.ckpt yet; starting from scratch."
                )
                config.ckpt_path = None
                return
            sys.exit(
                f"error: --ckpt_path last: no checkpoint found under {Path(root).resolve()}/version_*/checkpoints/. "
                "Train first with `python cli.py fit` (same --trainer.default_root_dir), or pass --ckpt_path FILE."
            )
        config.ckpt_path = str(last)
        if self.subcommand == "fit":
            for logger in self._logger_configs():
                if "version" in logger.init_args:
                    logger.init_args.version = last.parent.parent.name
        rank_zero_info(f"--ckpt_path last resolved to {last}")


def main(args: list[str] | None = None, run: bool = True, cli_class: type[CLI] | None = None) -> CLI:
    """Parses ``args`` (default: ``sys.argv``) on top of ``configs/mnist.yaml`` and runs the subcommand.

    With ``run=False`` there is no subcommand: the classes are only instantiated (used by tests and tools).
    ``cli_class`` replaces :class:`CLI` (``app.launch.slurm`` parses a command with it without running anything).
    """
    # allow_abbrev=False: a typo such as --trainer.max_epoch is an error, not silently another option
    defaults = {"default_config_files": [str(DEFAULT_CONFIG)], "allow_abbrev": False}
    with rendezvous_errors_explained():
        return (cli_class or CLI)(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            auto_configure_optimizers=False,  # optimizer and scheduler are model arguments (one way, see README)
            parser_kwargs={cmd: defaults for cmd in SUBCOMMANDS} if run else defaults,
            save_config_callback=TrackingConfigCallback,  # + config/env as hparams, run identity in ckpts
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )
