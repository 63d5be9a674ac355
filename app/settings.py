"""A checkpoint against the run's configuration: the checks of ``--ckpt_path`` that need the configuration (another
network, weights that do not fit), the hyperparameters and folders the CLI takes from a loaded checkpoint, and the
settings a resumed run changed (:class:`ChangedSettings`). The CLI (:mod:`app.command`), which owns the configuration,
calls these; reading the file is the checkpoint package's (:class:`app.checkpoint.Checkpoints`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint import CheckpointError, Checkpoints
from app.lightning_private import PATH


def _arch(checkpoint: dict) -> str | None:
    return (checkpoint.get("hyper_parameters") or {}).get("arch")


def check_arch(checkpoint: dict, path: PATH, arch: str | None) -> None:
    """Stops when the checkpoint's network (``model.arch`` in its hyperparameters) is not the one configured.

    LightningCLI would silently replace the configured ``model.arch`` by the checkpoint's; a run that asked for
    another network must say so instead.
    """
    saved = _arch(checkpoint)
    if saved is not None and arch is not None and saved != arch:
        raise CheckpointError(
            f"--ckpt_path {path} holds a {saved} network (model.arch in the checkpoint) but this run asks for "
            f"model.arch={arch}. Fix: --model.arch {saved} to continue that model, or leave --ckpt_path out to train "
            f"{arch} from scratch.",
            help="checkpoint-other-arch",
        )


def check_fits(checkpoint: dict, path: PATH, model: torch.nn.Module, arch: str | None = None) -> None:
    """Stops when the checkpoint's weights do not fit ``model`` (other network, classes or input channels),
    before the Trainer's ``load_state_dict`` would fail with a wall of missing keys and size mismatches."""
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return
    mine = model.state_dict()
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    wrong = [k for k in mine if k in saved and tuple(saved[k].shape) != tuple(mine[k].shape)]
    if not (missing or unexpected or wrong):
        return
    example = (
        f"{wrong[0]} is {list(saved[wrong[0]].shape)} there, {list(mine[wrong[0]].shape)} here"
        if wrong
        else f"{(missing or unexpected)[0]} is {'missing there' if missing else 'unknown here'}"
    )
    saved_arch = _arch(checkpoint) or "unknown"
    raise CheckpointError(
        (
            f"--ckpt_path {path} does not fit this model (model.arch={arch}): it was trained as {saved_arch} "
            f"and {len(wrong)} weight shapes differ, {len(missing)} are missing, {len(unexpected)} unknown "
            f"(e.g. {example}). "
            "Fix: run with the settings it was trained with (model.arch and the same data: classes and channels), "
            "or leave --ckpt_path out to start from scratch."
        ),
        help="checkpoint-does-not-fit",
    )


def read_given_checkpoint(config: Any, checkpoints: Checkpoints) -> dict | None:
    """Reads and checks ``--ckpt_path FILE`` before anything is built (missing, truncated, unsafe, other ``arch``).

    None for no path, the names resolved later (``last`` and ``hpc`` by the resume decision, the others by
    Lightning) and URLs.
    """
    path = config.get("ckpt_path")
    if not path or path in ("last", "best", "hpc", "registry") or "://" in str(path):
        return None
    checkpoint = checkpoints.given(path)
    check_arch(checkpoint, path, config.model.get("arch"))
    return checkpoint


def saved_hparams(checkpoint: dict) -> dict:
    """The model hyperparameters of ``checkpoint`` as LightningCLI applies them (``class_path`` + ``dict_kwargs``)."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    if "_class_path" in hparams:
        hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    return hparams


def weights_from_checkpoint(config: Any) -> None:
    """A run that loads a checkpoint takes the network's weights from it: ``model.weights`` (pretrained weights the
    first run started from) is not read again, so resuming or evaluating needs neither the file nor a download.
    The first run's ``config.yaml`` still names them."""
    weights = config.model.get("weights")
    if weights:
        rank_zero_info(f"model.weights {weights} not loaded: the checkpoint holds the network's weights")
        config.model.weights = None


def evaluation_dirpath(config: Any, checkpoint: dict | None) -> None:
    """validate/test/predict: ModelCheckpoint keeps the folder the loaded checkpoint was saved in.

    Outside ``fit`` it saves nothing, but Lightning restores its state from the checkpoint and, for a new run
    folder, warns that "the dirpath has changed" (or, without the callback, that it is missing): noise here.
    """
    saved = (checkpoint or {}).get("callbacks") or {}
    folders = {v.get("dirpath") for k, v in saved.items() if str(k).startswith("ModelCheckpoint")}
    if len(folders) != 1:
        return  # none saved, or several checkpoint callbacks: nothing to infer
    (folder,) = folders
    if config.get("checkpoint") is not None and config.checkpoint.get("dirpath") is None:  # the --checkpoint group
        config.checkpoint.dirpath = folder
    for callback in config.trainer.get("callbacks") or []:  # a ModelCheckpoint given in trainer.callbacks
        init_args = getattr(callback, "init_args", None)
        if init_args is not None and init_args.get("dirpath") is None and _is_model_checkpoint(callback):
            init_args.dirpath = folder


def _is_model_checkpoint(config: Any) -> bool:
    """Whether a ``class_path`` entry of the config names ModelCheckpoint or a subclass of it."""
    module, _, name = config.class_path.rpartition(".")
    return issubclass(getattr(importlib.import_module(module), name), ModelCheckpoint)


# settings that differ on every resume and mean nothing then
_NOT_COMPARED = ("ckpt_path", "config", "trainer.logger", "test_after_fit", "stacks_on")
# the optimizer's own hyperparameters live in its param groups, restored from the checkpoint; these are applied back
_OPTIMIZER = "model.optimizer.init_args."
_SCHEDULER = "model.lr_scheduler.init_args."
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # scaled together by a changed lr (OneCycleLR keeps all four)


def flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """The settings whose value differs between a checkpoint's run (``saved``) and this one: ``{key: (old, new)}``."""
    old, new = flat(saved), flat(current)
    keys = [k for k in {**old, **new} if not k.startswith(_NOT_COMPARED)]
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


class ChangedSettings(Callback):
    """A resumed fit whose configuration differs from its checkpoint's: one block lists the differences, and the
    optimizer and scheduler hyperparameters among them are applied to the restored state.

    Lightning restores the optimizer's param groups (lr, momentum, weight decay...) and the scheduler's state from
    the checkpoint, so a run resumed with ``--model.optimizer.init_args.lr 0.0123`` would train on with the saved lr
    and say nothing. A changed lr rescales the restored one (``lr``, ``initial_lr`` and the scheduler's ``base_lrs``):
    the schedule goes on from where it was, at the new scale. Other changes (epochs, logging, data workers) are
    honoured by the run itself; a changed network or data layout is refused before this (:func:`check_arch`,
    :func:`check_fits`).
    """

    def __init__(self, saved: dict | None, current: dict) -> None:
        self.changes = differences(saved, current) if saved is not None else {}
        self.saved_known = saved is not None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.saved_known:
            rank_zero_info("resume: the checkpoint holds no saved configuration (an older version wrote it): "
                           "settings not compared")  # fmt: skip
            return
        if not self.changes:
            return
        applied = self._apply(trainer)
        lines = [f"resume: {len(self.changes)} setting(s) differ from the checkpoint's run:"]
        for key, (old, new) in self.changes.items():
            note = applied.get(key, "")
            lines.append(f"  {key}: {old} -> {new}{note}")
        rank_zero_info("\n".join(lines))

    def _apply(self, trainer: Trainer) -> dict[str, str]:
        """Applies the changed optimizer and scheduler hyperparameters; ``{key: what was done}``."""
        done: dict[str, str] = {}
        for key, (old, new) in self.changes.items():
            if key == f"{_OPTIMIZER}lr" and _number(old) and _number(new) and old:
                done[key] = _rescale_lr(trainer, old, new)
            elif key.startswith(_OPTIMIZER):
                done[key] = _set_in_param_groups(trainer, key[len(_OPTIMIZER) :], new)
            elif key.startswith(_SCHEDULER):
                done[key] = _set_on_schedulers(trainer, key[len(_SCHEDULER) :], new)
        return {k: v for k, v in done.items() if v}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rescale_lr(trainer: Trainer, old: float, new: float) -> str:
    """The restored lr (and the schedule's start values) at ``new / old`` of what they were."""
    was = now = None
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            was = group["lr"] if was is None else was
            for k in _LR_KEYS:
                if k in group:
                    group[k] = _rescaled(group[k], old, new)
            now = group["lr"] if now is None else now
    for config in trainer.lr_scheduler_configs:
        if getattr(config.scheduler, "base_lrs", None) is not None:
            config.scheduler.base_lrs = [_rescaled(b, old, new) for b in config.scheduler.base_lrs]
    return f" (applied: the restored lr {was:.4g} -> {now:.4g} from your settings)" if was is not None else ""


def _set_in_param_groups(trainer: Trainer, name: str, new: Any) -> str:
    """An optimizer hyperparameter (momentum, weight_decay, betas...) set in every restored param group."""
    groups = [g for optimizer in trainer.optimizers for g in optimizer.param_groups if name in g]
    for group in groups:
        group[name] = tuple(new) if isinstance(new, list) else new
    return " (applied to the restored optimizer)" if groups else ""


def _set_on_schedulers(trainer: Trainer, name: str, new: Any) -> str:
    """A scheduler hyperparameter (total_iters, gamma...) set on every restored scheduler that has it."""
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if hasattr(c.scheduler, name)]
    for scheduler in schedulers:
        setattr(scheduler, name, new)
    return " (applied to the restored scheduler)" if schedulers else ""


def _rescaled(value: float, old: float, new: float) -> float:
    """``value`` of a schedule that started at ``old``, for one that starts at ``new`` (``new`` itself at the start)."""
    return new if math.isclose(value, old) else value * new / old
