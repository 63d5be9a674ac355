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
    """

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath"):
            state_dict = {**state_dict, "dirpath": os.path.realpath(os.path.expanduser(state_dict["dirpath"]))}
        super().load_state_dict(state_dict)
