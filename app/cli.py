"""The command line: LightningCLI with the project's defaults, links and run-directory conventions.

Run layout: ``<trainer.default_root_dir>/version_N/`` holds the TensorBoard events, ``config.yaml`` (the resolved
config) and ``checkpoints/`` (``last.ckpt`` plus the best by ``val/acc1``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import app  # noqa: F401  (registers the strategy names before the parser reads them)
from app.callbacks import StopAtAccuracy
from app.checkpoint import AtomicCheckpointIO, check_arch, check_fits, read_checkpoint
from app.errors import UsageError, UserError, explain_parser_error, one_line, parser_options
from app.launch.plan import apply_timeout, preflight, rendezvous_errors_explained
from app.loggers import TrackingConfigCallback, prepare_loggers
from app.quiet import silence_known_noise
from datamodules.imagenet import ImageNetDataError, UnreadableImageError
from datamodules.mnist import MNISTDataError
from modules import ImageClassifier
from modules.zoo import UnknownArchError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "mnist.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")
# Mistakes the user fixes: one `error: ...` line and a non-zero exit (main with run=True); bugs keep the traceback.
USER_ERRORS = (UserError, MNISTDataError, ImageNetDataError, UnreadableImageError, UnknownArchError)


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
        parser.add_argument(
            "--trust_checkpoint",
            type=bool,
            default=False,
            help="Load --ckpt_path (and every checkpoint of this run) with full unpickling, which can run code stored "
            "in the file. Only for legacy checkpoints you trust; by default they are loaded with weights_only=True "
            "and a file holding pickled Python objects is refused.",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # Lightning's version warns when both ``args`` and ``sys.argv`` hold arguments: the normal case for the
        # tools that build a run with ``main(ARGS, run=False)`` from their own command line (app.parity, bench).
        try:
            self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        except ArgumentError as err:  # jsonargparse's message is the whole usage text; ours names the closest option
            raise UsageError(explain_parser_error(str(err), parser_options(parser))) from None

    def _subcommand_config(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def _parse_ckpt_path(self) -> None:
        """Checks ``--ckpt_path FILE`` before anything is built, then applies its hyperparameters as Lightning does.

        Lightning's version loads the file with a traceback for a missing, truncated or unsafe file, and silently
        replaces a configured ``model.arch`` by the checkpoint's; each of these is a one-line error here instead.
        """
        self._checkpoint = None
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else None
        path = config.get("ckpt_path") if config is not None else None
        if not path or path in ("last", "best", "hpc", "registry") or "://" in str(path):
            return  # "last" is resolved (and checked) in before_instantiate_classes; URLs are left to Lightning
        self._checkpoint = read_checkpoint(path, trust=config.trust_checkpoint)
        check_arch(self._checkpoint, path, config.model.get("arch"))
        hparams = dict(self._checkpoint.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if hparams:
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        self._loggers_write_to_run_dir()
        self._resolve_last_checkpoint()
        config = self._subcommand_config()
        if config.get("ckpt_path") and self._checkpoint is None and Path(config.ckpt_path).is_file():
            self._checkpoint = read_checkpoint(config.ckpt_path, trust=config.trust_checkpoint)  # the resolved "last"
        self._evaluate_beside_the_checkpoint()
        prepare_loggers(self._subcommand_config(), self.subcommand)  # W&B group; resumed run's identity
        # launcher vs config, before any process group exists; rank 0 prints the plan, every rank stops on a problem
        preflight(self._subcommand_config(), timeout=self._subcommand_config().launch.timeout)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        config = self._subcommand_config()
        apply_timeout(self.trainer.strategy, config.launch.timeout)
        if config.trust_checkpoint and isinstance(self.trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            self.trainer.strategy.checkpoint_io.weights_only = False
        if getattr(self, "_checkpoint", None) is not None:  # before the Trainer's load_state_dict error wall
            check_fits(self._checkpoint, config.ckpt_path, self.model, self.model.hparams.get("arch"))

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

    def _evaluate_beside_the_checkpoint(self) -> None:
        """validate/test/predict: ModelCheckpoint keeps the folder the loaded checkpoint was saved in.

        Outside ``fit`` it saves nothing, but Lightning restores its state from the checkpoint and, for a new run
        folder, warns that "the dirpath has changed" (or, without the callback, that it is missing): noise here.
        """
        if self.subcommand in (None, "fit") or self._checkpoint is None:
            return
        saved = self._checkpoint.get("callbacks") or {}
        folders = {v.get("dirpath") for k, v in saved.items() if str(k).startswith("ModelCheckpoint")}
        if len(folders) != 1:
            return  # none saved, or several checkpoint callbacks: nothing to infer
        (folder,) = folders
        for callback in self._subcommand_config().trainer.get("callbacks") or []:
            init_args = getattr(callback, "init_args", None)
            if init_args is not None and init_args.get("dirpath") is None and _is_model_checkpoint(callback):
                init_args.dirpath = folder

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


def _is_model_checkpoint(config: Any) -> bool:
    """Whether a ``class_path`` entry of the config names ModelCheckpoint or a subclass of it."""
    module, _, name = config.class_path.rpartition(".")
    return issubclass(getattr(importlib.import_module(module), name), ModelCheckpoint)


def main(args: list[str] | None = None, run: bool = True, cli_class: type[CLI] | None = None) -> CLI:
    """Parses ``args`` (default: ``sys.argv``) on top of ``configs/mnist.yaml`` and runs the subcommand.

    With ``run=False`` there is no subcommand: the classes are only instantiated (used by tests and tools).
    ``cli_class`` replaces :class:`CLI` (``app.launch.slurm`` parses a command with it without running anything).
    """
    # allow_abbrev=False, on the subcommand parsers AND the main one: a typo such as --trainer.max_epoch is an error,
    # not silently taken for --trainer.max_epochs. Running as the command (run=True), parser errors reach
    # CLI.parse_arguments (exit_on_error=False) and user errors become one line; with run=False (tests, tools) the
    # caller gets the parser's own exit and the exceptions themselves.
    silence_known_noise()
    strict = {"allow_abbrev": False, "exit_on_error": not run}
    defaults = {"default_config_files": [str(DEFAULT_CONFIG)], **strict}
    with user_errors_explained() if run else contextlib.nullcontext(), rendezvous_errors_explained():
        return (cli_class or CLI)(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            auto_configure_optimizers=False,  # optimizer and scheduler are model arguments (one way, see README)
            parser_kwargs={**{cmd: defaults for cmd in SUBCOMMANDS}, **strict} if run else defaults,
            save_config_callback=TrackingConfigCallback,  # + config/env as hparams, run identity in ckpts
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )


@contextlib.contextmanager
def user_errors_explained() -> Iterator[None]:
    """A user mistake ends the process with ``error: <cause and fix>`` on stderr, exit status 1 (2: does not parse).

    Every rank runs the same checks (preflight, the DataModule's ``setup``), so each stops on its own; a rank that
    still waits for one that left is told so by ``app.callbacks.LostRank``. ``PreflightError`` (a ``SystemExit``
    carrying its ``error: ...`` message) needs no help here.
    """
    try:
        yield
    except USER_ERRORS as err:
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(getattr(err, "exit_code", 1)) from None
