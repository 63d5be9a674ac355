"""The run's checkpoint callback: Lightning's ``ModelCheckpoint``, configured by the ``--checkpoint.*`` CLI group."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import callbacks
from typing_extensions import override


class ModelCheckpoint(callbacks.ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``; a checkpoint saved under a relative run folder reloads without a warning.

    Lightning stores ``dirpath`` as it was resolved when the run started (``runs/mnist/version_0/checkpoints`` for
    the default relative run folder) but compares it, when the checkpoint is loaded, with its own ``realpath``-ed
    ``dirpath``: the same folder then reads as "the dirpath has changed" and the best-model state is dropped. The
    saved folder is resolved the same way before Lightning compares them.

    ``last.ckpt`` is the state training ended in. Lightning writes it at the end of ``fit`` only when the run wrote
    none yet: with ``--checkpoint.every_n_train_steps N`` (which switches off the end-of-epoch saves) the last one
    can be up to N - 1 steps old, and a run that ``--trainer.max_steps`` ends mid-epoch keeps the last one before
    it, so raising ``max_steps`` with ``--ckpt_path last`` would train those steps again. Here it is written at the
    end of ``fit`` unless this step is saved already; for ``max_steps`` mid-epoch, at that step's end instead
    (by the end of ``fit`` Lightning counts the unfinished epoch as completed): the same state as an
    ``every_n_train_steps`` save. At an epoch's last batch the validation's own save comes first, as usual.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        ended = 0 < trainer.max_steps <= trainer.global_step
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self.save_last and ended and not last_batch and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath"):
            state_dict = {**state_dict, "dirpath": os.path.realpath(os.path.expanduser(state_dict["dirpath"]))}
        super().load_state_dict(state_dict)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):  # this step not saved yet
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)
