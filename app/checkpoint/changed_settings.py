"""The settings a resumed fit changed since its checkpoint's run (:class:`ChangedSettings`): listed in one block, and
the optimizer's and scheduler's among them applied to the restored state."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

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
    honoured by the run itself; a changed network or data layout is refused before this
    (:mod:`app.checkpoint.against_config`).
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
