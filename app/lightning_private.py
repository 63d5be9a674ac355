"""Every private API of Lightning (and the few of torch) the app uses, in one place, each with its test
(tests/unit/test_lightning_private.py): an upgrade that moves or changes one fails that test, not a user's run.

Each is used only where Lightning offers no public way to do what the app needs; the reason is at the use. Reached
through the functions below (attributes of a running Trainer) or named in :data:`SUBCLASSED` (members the app's
subclasses of Lightning's classes override or call on themselves), where the test checks them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.cloud_io import _load
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer

# re-exported under the names the app uses
PATH = _PATH  # the path-like type of Lightning's checkpoint I/O signatures
PRECISION_INPUT = _PRECISION_INPUT  # the Trainer's precision values: app.trainer.Trainer's adds auto to them
load = _load  # Lightning's own checkpoint load (fsspec for URLs): what its TorchCheckpointIO calls
init_dist_connection = _init_dist_connection  # forms the process group as Lightning's strategies do
collect_rng_states, set_rng_states = _collect_rng_states, _set_rng_states  # torch's and Python's generators
ChildProcessObserver = _ChildProcessObserver  # the thread of Lightning's launcher that polls the other local ranks

# members of Lightning's classes that the app's subclasses override or use on themselves: class -> names
SUBCLASSED: dict[str, tuple[str, ...]] = {
    # app.callbacks.save_schedule.SaveSchedule: when last.ckpt is saved
    "lightning.pytorch.callbacks.ModelCheckpoint": (
        "_save_checkpoint",
        "_save_last_checkpoint",
        "_should_skip_saving_checkpoint",
        "_monitor_candidates",
        "_last_time_checked",
        "_every_n_train_steps",
        "_defer_save_until_validation",
    ),
    # app.callbacks.stop_at_accuracy.StopAtAccuracy: the stop's check and its reason
    "lightning.pytorch.callbacks.EarlyStopping": (
        "_should_skip_check",
        "_run_early_stopping_check",
        "_evaluate_stopping_criteria",
    ),
    # app.command.CLI: the --ckpt_path checks, running the subcommand, one subcommand's parser
    "lightning.pytorch.cli.LightningCLI": ("_parse_ckpt_path", "_run_subcommand", "_parser"),
    # app.checkpoint.background.BackgroundSaves: the thread pool of Lightning's asynchronous saves
    "lightning.pytorch.plugins.io.AsyncCheckpointIO": ("_executor", "_ensure_setup"),
    # app.loggers.WandbLogger: wandb.init's arguments, the run, the folder
    "lightning.pytorch.loggers.WandbLogger": ("_wandb_init", "_experiment", "_save_dir"),
    # app.strategies (ddp_mp, allreduce), app.launch.rendezvous, app.callbacks.debug_checks: the process group
    "lightning.pytorch.strategies.DDPStrategy": (
        "_timeout",
        "_process_group_backend",
        "_get_process_group_backend",
        "_ddp_kwargs",
        "_setup_model",
    ),
    # app.trainer.Trainer: builds the checkpoint dict itself, to share rank 0's save failure
    "lightning.pytorch.Trainer": ("_checkpoint_connector",),
    # app.sync_batchnorm.CPUSyncBatchNorm: torch's input check of BatchNorm layers
    "torch.nn.modules.batchnorm._BatchNorm": ("_check_input_dim",),
}


def should_accumulate(trainer: Trainer) -> bool:
    """Whether this training batch is inside a gradient accumulation (no optimizer step at its end): a stop or a save
    waits for the step, since a partial accumulation is not in checkpoints."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Switches off, for this run's loop only, Lightning's broadcast of rank 0's SIGTERM flag before every training
    batch (a blocking collective and a host sync per step), once the app's own handler has replaced Lightning's: its
    flag could then only carry 0 (:class:`app.callbacks.SIGTERMCheckpoint`). An instance attribute; the class stays."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def restore_sigterm_broadcast(trainer: Trainer) -> None:
    """Undoes :func:`skip_sigterm_broadcast`."""
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


def cluster_environment(trainer: Trainer) -> Any:
    """The cluster environment the Trainer chose (SLURM's tells whether it requeues on SIGUSR1)."""
    return trainer._accelerator_connector.cluster_environment


def slurm_requeue(trainer: Trainer, signum: int) -> None:
    """Lightning's own SLURM routine after its requeue signal: finalize the loggers, save ``hpc_ckpt_N.ckpt``, and
    rank 0 calls ``scontrol requeue``; run at a step boundary on every rank (:class:`app.callbacks.SLURMRequeue`)."""
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)


def logged_keys(trainer: Trainer) -> list[str]:
    """The metric keys this rank has logged so far in the running loop (``--launch.debug``'s check)."""
    return sorted(trainer._results.keys())


def dump_checkpoint(trainer: Trainer, weights_only: bool | None) -> dict:
    """The checkpoint dict ``Trainer.save_checkpoint`` would write (every rank builds it; rank 0 writes it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only)


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The process-group timeout a DDP-like strategy will pass to ``init_process_group`` (None for others)."""
    return getattr(strategy, "_timeout", None)


def set_strategy_timeout(strategy: Any, timeout: timedelta) -> None:
    """Sets it before the group forms: a strategy given by name (``--trainer.strategy ddp``) cannot carry
    ``timeout``; Lightning keeps it in ``_timeout`` until ``setup_environment``."""
    if hasattr(strategy, "_timeout"):
        strategy._timeout = timeout


def process_group_backend(strategy: Any) -> str | None:
    """The backend the strategy will form its process group with (None for a strategy without one)."""
    backend = getattr(strategy, "_get_process_group_backend", None)
    return backend() if callable(backend) else None


def ddp_kwargs(strategy: Any) -> dict | None:
    """The arguments a DDP strategy passes to ``DistributedDataParallel`` (None for others)."""
    return getattr(strategy, "_ddp_kwargs", None)


def child_processes(observer: Any) -> list:
    """The local ranks Lightning's launcher started, as its observer thread holds them."""
    return list(getattr(observer, "_child_processes", []))


def on_child_death(observer: Any, handler: Any) -> None:
    """What Lightning's observer (the class, or one running thread) does when a local rank died: ``handler`` instead
    of its own SIGKILL of every rank (it has no hook for it)."""
    observer._terminate_all = handler
