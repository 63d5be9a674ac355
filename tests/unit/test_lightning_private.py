"""Every private Lightning (and torch) API the app uses (``app.lightning_private``), each checked against the installed
release: an upgrade that renames, moves or changes one fails here, with its name, instead of in a user's run."""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from app import lightning_private as private


def instance(class_path: str):
    """An object of the class the private members belong to (instance attributes exist only on one)."""
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    made = {
        ModelCheckpoint: lambda: ModelCheckpoint(),
        EarlyStopping: lambda: EarlyStopping(monitor="val/acc1"),
        AsyncCheckpointIO: lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        DDPStrategy: lambda: DDPStrategy(parallel_devices=[torch.device("cpu")], find_unused_parameters=True),
        Trainer: lambda: Trainer(accelerator="cpu", logger=False, enable_progress_bar=False),
    }
    if name == "WandbLogger":
        return cls(offline=True)
    return made[cls]() if cls in made else cls


ENTRIES = [(class_path, member) for class_path, names in private.SUBCLASSED.items() for member in names]


@pytest.mark.parametrize(("class_path", "member"), ENTRIES, ids=[f"{c.rsplit('.', 1)[1]}.{m}" for c, m in ENTRIES])
def test_each_private_member_the_app_subclasses_use_exists(class_path, member, tmp_path, monkeypatch):
    if class_path.endswith("WandbLogger"):
        pytest.importorskip("wandb")
        monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert hasattr(instance(class_path), member), f"{class_path}.{member} is gone: see app/lightning_private.py"


class Observes(Callback):
    """Calls each accessor on a running Trainer and keeps what they answered."""

    def __init__(self) -> None:
        self.accumulating: list[bool] = []
        self.keys: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.accumulating.append(private.should_accumulate(trainer))
        pl_module.log("private/seen", float(batch_idx))
        self.keys = private.logged_keys(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.environment = private.cluster_environment(trainer)
        self.checkpoint = private.dump_checkpoint(trainer, False)
        loop = trainer.fit_loop.epoch_loop
        private.skip_sigterm_broadcast(trainer)
        self.skipped = "_broadcast_sigterm_tensor" in vars(loop) and loop._broadcast_sigterm_tensor() is None
        private.restore_sigterm_broadcast(trainer)
        self.restored = "_broadcast_sigterm_tensor" not in vars(loop) and callable(loop._broadcast_sigterm_tensor)
        self.requeue = trainer._signal_connector._slurm_sigusr_handler_fn  # slurm_requeue's target (run: slurm tests)


def test_the_private_trainer_attributes_answer_as_the_app_expects(tmp_path):
    observes = Observes()
    trainer = Trainer(
        accelerator="cpu", max_steps=4, accumulate_grad_batches=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[observes],
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert observes.accumulating[:4] == [True, False, True, False]  # inside the accumulation, then the step
    assert observes.keys == ["on_train_batch_end.private/seen"]  # the hook and the key, as the debug check names them
    assert isinstance(observes.environment, LightningEnvironment)
    assert {"state_dict", "optimizer_states", "global_step"} <= set(observes.checkpoint)
    assert observes.skipped and observes.restored and callable(observes.requeue)


def test_the_private_strategy_attributes_and_helpers(tmp_path):
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")], find_unused_parameters=True)
    assert private.strategy_timeout(strategy) is not None
    private.set_strategy_timeout(strategy, timedelta(seconds=7))
    assert private.strategy_timeout(strategy) == timedelta(seconds=7)
    assert private.process_group_backend(strategy) == "gloo"
    assert private.ddp_kwargs(strategy) == {"find_unused_parameters": True}
    assert callable(private.init_dist_connection)

    torch.save({"w": torch.ones(3)}, tmp_path / "x.ckpt")
    assert torch.equal(private.load(tmp_path / "x.ckpt", weights_only=True)["w"], torch.ones(3))
    state = private.collect_rng_states(include_cuda=False)
    first = torch.rand(3)
    private.set_rng_states(state)
    assert torch.equal(torch.rand(3), first)

    observer = private.ChildProcessObserver(main_pid=os.getpid(), child_processes=[])
    assert private.child_processes(observer) == [] and callable(private.ChildProcessObserver._terminate_all)
    private.on_child_death(observer, lambda: "handled")
    assert observer._terminate_all() == "handled"


def test_the_precision_values_the_trainer_adds_auto_to_are_lightnings():
    """``app.trainer.Trainer`` types ``precision`` as Lightning's values plus ``auto``: the CLI lists them when a value
    is wrong, so they must be the ones Lightning's Trainer accepts."""
    from typing import get_args

    values = {str(v) for arg in get_args(private.PRECISION_INPUT) for v in get_args(arg)}
    assert {"16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true"} <= values
