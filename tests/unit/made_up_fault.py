"""A throwaway fault kind, registered on import: the ranks' weights no longer match (a silent corruption: a bit
flipped in a device's memory or on the wire), which a (made-up) library finds by comparing checksums across the ranks
and reports on every rank as a :class:`ChecksumMismatch`. Nothing else in the repository names it: the command's
error channel finds it through the kinds' one list (:data:`app.resilience.faults.KINDS`); its section of
docs/troubleshooting.md would be the one other edit.

``tests/unit/test_made_up_fault.py`` registers it for its own tests (and removes it after); the processes of its
heal test import this module because their config names its injector, :class:`DivergeAt`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from app.resilience.faults import Fault, register
from tools.resume_probe import in_attempt


class ChecksumMismatch(RuntimeError):
    """What the library raises on every rank: the checksums of the ranks' weights differ."""


class WeightsDiverged(Fault):
    """The kind: its anchor, and its translator (the detector: a :class:`ChecksumMismatch` reached the command)."""

    help = "weights-diverged"

    @classmethod
    def named(cls, err: BaseException, plan: Any = None) -> WeightsDiverged | None:
        if not isinstance(err, ChecksumMismatch):
            return None
        return cls(
            f"the ranks' weights no longer match ({err}): a silent corruption. Fix: check the nodes' memory (ECC "
            "errors: `nvidia-smi -q -d ECC`); the last checkpoint is intact (resume with --ckpt_path last; under "
            "--launch.max_restarts the job restarts by itself)."
        )


class DivergeAt(Callback):
    """The injector: every rank raises a :class:`ChecksumMismatch` when the training batch that makes global step
    ``step - 1`` ends; ``attempt`` as for :class:`tools.resume_probe.SignalAt`."""

    def __init__(self, step: int = 3, attempt: int | None = 0) -> None:
        self.step, self.attempt = step, attempt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 and in_attempt(self.attempt):
            raise ChecksumMismatch(f"global step {trainer.global_step}: 0x5f3759df on rank 0, 0x5f3759de on rank 1")


register(WeightsDiverged)
