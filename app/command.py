"""The command line: LightningCLI with the project's defaults, links and run-directory conventions.

It wires, it does not compute: importing it registers the strategy names (``app.strategies``); reading a
checkpoint, checking it against the configuration and deciding what to resume are the checkpoint package's (asked
once: :meth:`app.checkpoint.Checkpoints.prepare`), logger folders :mod:`app.loggers`', the plan
:mod:`app.launch.preflight`'s. Every user mistake and fault (any :class:`~core.errors.UserError`) ends here, in one
channel (:func:`user_errors_explained`): one ``error:`` line, and a SLURM requeue after a fault. The ``--local-rank``
that ``python -m torch.distributed.launch`` adds is taken out of the arguments here.

Configs: ``configs/base.yaml`` (the machinery: default callbacks, the ``--checkpoint`` group, checkpoint I/O, logger) is
always loaded, then one recipe: ``configs/mnist.yaml`` unless a ``--config`` file names its own ``data.class_path``.
Run layout: :mod:`app.checkpoint.names`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import Callback, LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint as AnyModelCheckpoint
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import app.strategies  # noqa: F401  (registers the strategy names before the parser reads them)
from app.callbacks import DEFAULTS, EMA, SaveSchedule, StopAtAccuracy
from app.callbacks.debug_checks import DEBUG_HANG_TIMEOUT, DebugChecks, apply_debug, capture_rank_logs
from app.checkpoint import Checkpoints, Resume
from app.launch.elastic import run_by_agent
from app.launch.preflight import preflight
from app.launch.rendezvous import HeldPort, apply_timeout, join_this_attempt
from app.loggers import (
    TrackingConfigCallback,
    continue_run_of,
    prepare_loggers,
    redact,
    resolved_config,
    run_dir_for_loggers,
    write_to_run_dir,
)
from app.quiet import silence_known_noise
from app.resilience.faults import Fault, faults_named, named
from app.resilience.hang_watch import apply_flight_recorder, effective_timeout, startup_allowance
from app.resilience.hang_watch import install as install_hang_watch
from app.resilience.lost_rank import watch_the_start_up
from app.resilience.requeue import Requeue
from app.sync_batchnorm import with_sync_batchnorm
from app.trainer import Trainer
from core.env import Launch, detect, export_unset, seconds_since_process_start, split_local_rank
from core.errors import UsageError, explain_parser_error, parser_options, report
from modules import ImageClassifier

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = ROOT / "configs" / "base.yaml"  # always loaded first
DEFAULT_RECIPE = ROOT / "configs" / "mnist.yaml"  # unless a --config file is a recipe (names data.class_path)
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class CLI(LightningCLI):
    """LightningCLI with the app's options and links; each step it adds is one call into the module that owns it."""

    plan = None  # the preflight plan of this run (set before the classes are instantiated)
    resume: Resume | None = None  # what this run resumes from, and the checkpoint it loads (read and checked once)
    launch: Launch | None = None  # this process's launcher and job, read once

    def __init__(self, *args: Any, requeue: Requeue | None = None, port: HeldPort | None = None, **kwargs: Any) -> None:
        # the command's: a SLURM job's requeue after a fault (armed for a fit), the rendezvous port held for the run
        self.requeue, self.port = requeue or Requeue(), port or HeldPort()
        # the subcommand this command line runs, when it comes first: only its parser is built (LightningCLI builds
        # all four, each from every class signature: about 0.1 s each on a 2-core CPU, paid by every start)
        given = kwargs.get("args") or []
        self._only = given[0] if isinstance(given, list) and given and given[0] in SUBCOMMANDS else None
        if self._only and isinstance(kwargs.get("parser_kwargs"), dict):  # the other subcommands' parser settings
            kwargs["parser_kwargs"] = {
                k: v for k, v in kwargs["parser_kwargs"].items() if k == self._only or k not in SUBCOMMANDS
            }
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  (a staticmethod in LightningCLI)
        every = LightningCLI.subcommands()
        return {self._only: every[self._only]} if self._only else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The datamodule knows its classes and channels; the model is told, never configured twice.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.in_channels", "model.in_channels", apply_on="instantiate")
        # Always present (a no-op without a target) and set with `--stop_at_accuracy.target 75` or a YAML fragment:
        # an entry of trainer.callbacks could only be configured by restating the whole list.
        parser.add_lightning_class_args(StopAtAccuracy, "stop_at_accuracy")
        for name, callback in DEFAULTS.items():
            parser.add_argument(
                f"--callbacks.{name}",
                type=bool,
                default=True,
                help=f"Add {callback.__module__.rsplit('.', 1)[0]}.{callback.__name__} (false: leave it out; one of "
                "that class in trainer.callbacks replaces it).",
            )
        # SaveSchedule's arguments (Lightning's ModelCheckpoint's and its own) as a group, built in
        # instantiate_trainer: not added at all when --trainer.enable_checkpointing is false (Lightning refuses a
        # checkpoint callback then)
        parser.add_class_arguments(SaveSchedule, "checkpoint", instantiate=False)
        # the weights' moving average (off without a decay), a group for the same reason; built in default_callbacks
        parser.add_class_arguments(EMA, "ema", instantiate=False)
        add_launch_arguments(parser)
        add_run_arguments(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # Lightning's version warns when both ``args`` and ``sys.argv`` hold arguments: the normal case for the
        # tools that build a run with ``main(ARGS, run=False)`` from their own command line (tools.parity, bench).
        try:
            self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        except ArgumentError as err:  # jsonargparse's message is the whole usage text; ours names the closest option
            raise explain_parser_error(str(err), parser_options(parser)) from None

    def _subcommand_config(self) -> Namespace:
        subcommand = self.config.get("subcommand")  # also before LightningCLI sets self.subcommand
        return self.config[subcommand] if subcommand else self.config

    def _parse_ckpt_path(self) -> None:
        """Nothing here: LightningCLI's version loads ``--ckpt_path`` with a traceback for a missing, truncated or
        unsafe file and silently replaces a configured ``model.arch`` by the checkpoint's. The run enters its
        checkpoints once, in :meth:`instantiate_classes`, where each of these is a one-line error."""

    def instantiate_classes(self) -> None:
        """The run's one question to its checkpoints, before anything is built: what it resumes from, checked and
        read once (:meth:`Checkpoints.prepare`), a given file's hyperparameters applied as Lightning applies them;
        then the run folder, loggers and plan (:meth:`_before_build`), the classes, and the checkpoint's I/O and
        checks attached to what was built (:meth:`Checkpoints.attach`)."""
        subcommand = self.config.get("subcommand")
        self.launch = detect()
        self.resume = Checkpoints.prepare(self._subcommand_config(), subcommand, self.launch)
        if self.resume.hparams:
            self.config = self.parser.parse_object({subcommand: {"model": self.resume.hparams}}, self.config)
        Checkpoints.configure(self.resume, self._subcommand_config())
        self._before_build()
        super().instantiate_classes()
        self._after_build()
        config = self._subcommand_config()
        # the run's configuration as a checkpoint keeps it, for a fit that resumes one
        saved_as = lambda: redact(resolved_config(self._parser(self.subcommand), config))  # noqa: E731
        Checkpoints.attach(self.resume, self.trainer, self.model, config, saved_as)

    def _before_build(self) -> None:
        config, resume, launch = self._subcommand_config(), self.resume, self.launch
        config.stacks_on = None  # loaded already (default_config_files); the run's saved config.yaml is whole
        write_to_run_dir(config)
        if resume.source.found_here and resume.path and self.subcommand == "fit":
            continue_run_of(config, resume.path)
        prepare_loggers(config, self.subcommand, resume)  # W&B group; the checkpoint's run identity
        # launcher vs config, before any process group exists; rank 0 prints the plan, every rank stops on a problem
        hang = config.launch.hang_timeout
        if config.launch.debug:
            hang = min(hang, DEBUG_HANG_TIMEOUT) if hang else DEBUG_HANG_TIMEOUT
        startup = startup_allowance(hang, config.launch.startup_timeout, config.launch.timeout)
        hang = effective_timeout(hang, config.launch.timeout)
        restarts = config.launch.max_restarts if self.subcommand == "fit" else 0
        self.plan = preflight(
            config, timeout=config.launch.timeout, hang_timeout=hang, resume=resume, max_restarts=restarts,
            startup_timeout=startup, launch=launch,
        )  # fmt: skip
        if port := self.port.hold(self.plan):  # the ranks Lightning starts meet there; no other job can take it
            rank_zero_info(f"rendezvous: port {port} of this host, held for this run until it ends")
        # --launch.max_restarts: torch's elastic agent runs the ranks; this process ends there
        run_by_agent(self.plan, port or launch.master_port)
        if launch.launcher == "slurm":  # --launch.max_restarts: a fault requeues the job (any sbatch script)
            self.requeue.arm(restarts, Path(self.plan.root_dir), launch)

    def _after_build(self) -> None:
        config = self._subcommand_config()
        apply_timeout(self.trainer.strategy, config.launch.timeout)
        hang, startup = (self.plan.hang_timeout, self.plan.startup_timeout) if self.plan else (None, None)
        install_hang_watch(self.trainer, hang or 0, startup, self.requeue)
        self.requeue.trainer = self.trainer  # the step of a fault, in its record
        apply_flight_recorder(self.trainer.strategy, Path(self.trainer.default_root_dir) / "nccl_trace")
        if config.launch.debug:
            folder = Path(self.trainer.default_root_dir) / "debug"
            made = apply_debug(folder)
            capture_rank_logs(self.trainer.strategy, folder)
            self.trainer.callbacks.append(DebugChecks())
            rank_zero_info(
                f"--launch.debug: {' '.join(f'{k}={v}' for k, v in made.items()) or '(your debug variables kept)'}; "
                f"hang timeout {self.plan.hang_timeout:g} s; checks: the same number of batches on every rank at each "
                "epoch's start, the same metric keys on each logging step; torch's distributed log of each rank in "
                f"{folder / 'rank<R>.log'}"
            )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # sync_batchnorm: the app's LayerSync, which also works on CPU (Lightning's converts to torch's SyncBatchNorm)
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config.trainer
        if trainer.get("sync_batchnorm"):
            kwargs.setdefault("plugins", with_sync_batchnorm(trainer.get("plugins")))
        # the default callbacks (--callbacks.NAME, --checkpoint.*) first, then the config's own trainer.callbacks
        given = trainer.get("callbacks") or []
        given = list(given) if isinstance(given, list) else [given]
        kwargs.setdefault("callbacks", default_callbacks(config, given) + given)
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        """``--test_after_fit best|last``: the test set on that checkpoint, in this process."""
        which = self._subcommand_config().test_after_fit
        if which == "none" or self.trainer.interrupted:
            return
        checkpoint = self.trainer.checkpoint_callback
        ckpt_path = which if checkpoint is not None and (checkpoint.best_model_path or which == "last") else None
        weights = ckpt_path or "final"
        rank_zero_info(f"test_after_fit: the test set on the {weights} weights")
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt_path)
        acc, took = (results[0].get("test/acc1") if results else None), seconds_since_process_start()
        if acc is not None:  # what `make demo` ends with: the accuracy, and what it cost
            rank_zero_info(
                f"test_after_fit: test/acc1 {acc:.2%} on the {weights} weights"
                + (f"; {took:.1f} s since this process started, imports, fit and test included" if took else "")
            )

    def _run_subcommand(self, subcommand: str) -> None:
        with faults_named(self.plan):  # a rendezvous timeout, named with the ranks the plan expected
            join_this_attempt(self.trainer.strategy, self.plan.launch)  # not the addresses of a previous attempt
            super()._run_subcommand(subcommand)


def main(args: list[str] | None = None, run: bool = True, cli_class: type[CLI] | None = None) -> CLI:
    """Parses ``args`` (default: ``sys.argv``) on top of :func:`default_config_files` and runs the subcommand.

    With ``run=False`` there is no subcommand: the classes are only instantiated (used by tests and tools).
    ``cli_class`` replaces :class:`CLI` (``tools.slurm`` parses a command with it without running anything).
    """
    # allow_abbrev=False, on the subcommand parsers AND the main one: a typo such as --trainer.max_epoch is an error,
    # not silently taken for --trainer.max_epochs. Running as the command (run=True), parser errors reach
    # CLI.parse_arguments (exit_on_error=False) and user errors become one line; with run=False (tests, tools) the
    # caller gets the parser's own exit and the exceptions themselves.
    silence_known_noise()
    watch_the_start_up()  # a local rank that dies while the job starts: the app's line, not Lightning's SIGKILL
    args = run_dir_for_loggers(accept_local_rank(sys.argv[1:] if args is None else args))
    strict = {"allow_abbrev": False, "exit_on_error": not run}
    requeue, port = Requeue(), HeldPort()  # the command's: armed and held by the CLI for its run
    with user_errors_explained(requeue) if run else contextlib.nullcontext(), contextlib.ExitStack() as ending:
        ending.callback(port.release)  # the rendezvous port held for the run
        defaults = {"default_config_files": default_config_files(args), **strict}
        return (cli_class or CLI)(
            ImageClassifier,
            LightningDataModule,
            subclass_mode_data=True,
            auto_configure_optimizers=False,  # optimizer and scheduler are model arguments (one way, see README)
            parser_kwargs={**{cmd: defaults for cmd in SUBCOMMANDS}, **strict} if run else defaults,
            save_config_callback=TrackingConfigCallback,  # + config/env as hparams, run identity in ckpts
            save_config_kwargs={"overwrite": True},
            trainer_class=Trainer,  # a full disk during a save stops every rank with one line
            args=args,
            run=run,
            requeue=requeue,
            port=port,
        )


def add_launch_arguments(parser: LightningArgumentParser) -> None:
    """The ``--launch.*`` group: how the ranks meet, wait and restart."""
    parser.add_argument(
        "--launch.timeout",
        type=float | None,
        default=None,
        help="Seconds the ranks wait for each other at start-up and in collectives before failing with a message "
        "naming who is missing (default: the strategy's own, 1800 s for ddp).",
    )
    parser.add_argument(
        "--launch.hang_timeout",
        type=float,
        default=600.0,
        help="Seconds without a finished training or validation step on any rank before a multi-process job is "
        "declared stuck: rank 0 names the rank behind and where it is, and every rank exits with status 1. 0 "
        "turns the watch off. Checkpoint saves are not counted; the job's start has its own allowance "
        "(--launch.startup_timeout).",
    )
    parser.add_argument(
        "--launch.startup_timeout",
        type=float | None,
        default=None,
        help="The hang watch's allowance while a multi-process fit starts: from the training set-up (after the "
        "data's) through the sanity check to the end of the first training step, which may compile, start loader "
        "workers or read a large index. A rank without progress for this long is named with where it is. Default: "
        "twice --launch.hang_timeout, at least 300 s, inside --launch.timeout.",
    )
    parser.add_argument(
        "--launch.max_restarts",
        type=int,
        default=0,
        help="fit only: how often a fault (a rank that dies or hangs, a lost loader worker) restarts the job, "
        "which resumes from its newest checkpoint. Under Lightning's launcher (several processes on one node) "
        "torch's elastic agent runs the ranks and restarts the group; under SLURM it is the job's fault budget, each "
        "fault recorded in RUN_DIR/faults.jsonl, preemption and wall-time requeues not counted (the requeue by the "
        "batch script of tools.slurm submit, or by the app in your own script with #SBATCH --requeue); under "
        "torchrun, torchrun's --max-restarts applies instead. Default 0, as torchrun's: a restart repeats the "
        "start-up, and a deterministic failure would be repeated that many times; 2 for unattended jobs.",
    )
    parser.add_argument(
        "--launch.debug",
        type=bool,
        default=False,
        help="The preset for a bad day: TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=INFO, with torch's "
        "distributed log of each rank in <default_root_dir>/debug/rank<R>.log, a hang timeout of 120 s at most, "
        "and checks that every rank has the same number of batches at each epoch's start and logs the same metric "
        "keys on each logging step.",
    )


def add_run_arguments(parser: LightningArgumentParser) -> None:
    """The options of the run itself: the recipe it stacks on, the test after fit, trusting its checkpoints."""
    parser.add_argument(
        "--stacks_on",
        type=str | None,
        default=None,
        help="In a recipe file: the recipe it varies, relative to the file, loaded before it (configs/"
        "imagenet_apex.yaml: `stacks_on: imagenet.yaml`), so that it states only what differs.",
    )
    parser.add_argument(
        "--test_after_fit",
        type=Literal["none", "best", "last"],
        default="none",
        help="fit only: when training ends, test in the same process on the best checkpoint (the monitored "
        "metric's) or on last.ckpt, as `cli.py test --ckpt_path best|last` would, without a second start-up. "
        "With checkpointing off, the weights at the end of fit are tested. Ignored by validate, test and predict.",
    )
    parser.add_argument(
        "--trust_checkpoint",
        type=bool,
        default=False,
        help="Load --ckpt_path (and every checkpoint of this run) with full unpickling, which can run code stored "
        "in the file. Only for legacy checkpoints you trust; by default they are loaded with weights_only=True "
        "and a file holding pickled Python objects is refused.",
    )


def default_config_files(args: list[str]) -> list[str]:
    """``configs/base.yaml``, then the recipes the ``--config`` files in ``args`` stack on, else ``configs/mnist.yaml``.

    A recipe names its data (``data.class_path``: configs/imagenet.yaml, a run's saved config.yaml) and states what
    it trains from the class defaults, so it does not undo MNIST's settings; any other config (strategy/,
    precision/, logger/, a file that only sets ``data.init_args``) stacks on the default recipe. A recipe that
    varies another says so with ``stacks_on: imagenet.yaml`` (relative to itself): that one is loaded before it, so
    it states only what differs (configs/imagenet_apex.yaml). jsonargparse's own nested ``config:`` key cannot do
    this: the nested file's groups are replaced, not merged, by the outer file's.
    """
    given = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--config", "-c")]
    given += [arg.partition("=")[2] for arg in args if arg.startswith("--config=")]
    recipes = [path for path in given if _is_recipe(path)]
    bases = [base for path in recipes for base in _stacked_on(Path(path))]
    return [str(BASE_CONFIG)] + (bases if recipes else [str(DEFAULT_RECIPE)])


def _read_yaml(path: str | Path) -> dict:
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):  # the parser reports a missing or broken file
        return {}
    return config if isinstance(config, dict) else {}


def _is_recipe(path: str) -> bool:
    data = _read_yaml(path).get("data")
    return isinstance(data, dict) and "class_path" in data


def _stacked_on(path: Path) -> list[str]:
    """The recipes ``path`` stacks on, the first to load first (``stacks_on``, followed to its own base)."""
    base = _read_yaml(path).get("stacks_on")
    if not base:
        return []
    target = (path.parent / base).resolve()
    if not target.is_file():
        raise UsageError(f"stacks_on: {base} in {path}: no such file. Fix: a recipe's path relative to {path.parent}.")
    return [*_stacked_on(target), str(target)]


def default_callbacks(config: Namespace, given: list[Callback]) -> list[Callback]:
    """The callbacks every run gets (``--callbacks.NAME``, ``--checkpoint.*``), except those switched off, those of
    a class ``given`` (``trainer.callbacks``) already holds, and the checkpoint without checkpointing; the weights'
    average (``--ema.*``) first when a decay is given: it updates at a step's end before anything saves that step."""

    def wanted(cls: type) -> bool:
        return not any(isinstance(callback, cls) for callback in given)

    switches = config.get("callbacks") or {}
    chosen = [cls() for name, cls in DEFAULTS.items() if switches.get(name, True) and wanted(cls)]
    checkpoint, enabled = config.get("checkpoint"), config.trainer.get("enable_checkpointing") is not False
    if checkpoint is not None and enabled and wanted(AnyModelCheckpoint):
        chosen.insert(0, SaveSchedule(**checkpoint))
    ema = EMA(**(config.get("ema") or {}))
    if ema.enabled and wanted(WeightAveraging):
        chosen.insert(0, ema)
    return chosen


def accept_local_rank(args: list[str]) -> list[str]:
    """``args`` without the ``--local-rank=K`` of ``python -m torch.distributed.launch`` (which LightningCLI would
    reject), with ``LOCAL_RANK`` set from K when the launcher did not set it: Lightning reads the rank from there."""
    args, local_rank = split_local_rank(args)
    if local_rank is not None:
        export_unset({"LOCAL_RANK": local_rank})
    return args


@contextlib.contextmanager
def user_errors_explained(requeue: Requeue | None = None) -> Iterator[None]:
    """The one error channel: a user mistake or a fault (any :class:`~core.errors.UserError`) ends the process with
    its line on stderr (``error: <cause and fix> Help: <its section>``, :func:`core.errors.report`), exit status 1
    (2: does not parse); after a fault (:class:`app.resilience.faults.Fault`), a SLURM job with requeues left goes
    back in the queue (``requeue``).

    Every rank runs the same checks (preflight, the DataModule's ``setup``) and stops with the same errors (a full
    disk, a failed debug check), so each says its own line; a rank that still waits for one that left is told so by
    ``app.callbacks.LostRank``. An exception that a fault's translator names (a DataLoader worker that died, reported
    by torch as a ``RuntimeError``: :func:`app.resilience.faults.named`) is such a fault too; any other exception is a
    bug and keeps its traceback.
    """
    try:
        yield
    except Exception as raised:
        err = named(raised)
        if err is None:
            raise
        report(err)
        if isinstance(err, Fault) and requeue is not None:
            requeue.after_fault(err)  # under SLURM with --launch.max_restarts: back in the queue
        raise SystemExit(err.exit_code) from None
