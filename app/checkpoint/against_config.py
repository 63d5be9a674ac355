"""A checkpoint against the run's configuration: the checks of ``--ckpt_path`` that need the configuration (another
network, weights that do not fit), and the hyperparameters and folders the configuration takes from a loaded
checkpoint. :meth:`app.checkpoint.Checkpoints.prepare` and :meth:`~app.checkpoint.Checkpoints.attach` ask these.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint.reading import CheckpointError
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
