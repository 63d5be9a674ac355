"""The CLI's ``Trainer``: Lightning's, with checkpoint saves that fail on every rank together."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint import DiskFullError
from app.lightning_private import PATH, PRECISION_INPUT, dump_checkpoint
from core.device import AUTO, auto_precision, on_cuda


def resolve_benchmark(benchmark: bool | None, deterministic: Any) -> bool | None:
    """``benchmark`` off whenever ``deterministic`` is on, said in one line. Lightning keeps both and only warns, but
    cuDNN's autotuner may then pick other (deterministic) kernels in a resumed process, and a resume is no longer
    exact (``configs/imagenet.yaml`` sets ``benchmark: true``)."""
    if benchmark and deterministic not in (None, False):
        rank_zero_info(
            "trainer.benchmark off: trainer.deterministic is on, and cuDNN's autotuner could pick other kernels "
            "after a resume"
        )
        return False
    return benchmark


class Trainer(LightningTrainer):
    """Lightning's ``Trainer`` (the CLI's ``trainer_class``) whose checkpoint saves fail on every rank together.

    Only rank 0 writes a checkpoint, while the others wait at the barrier that follows. When rank 0's save finds
    the disk full, Lightning's version would end rank 0 with a traceback, and the waiting ranks would then see a
    peer that vanished (and report rank 0 as lost). Here rank 0 joins the barrier anyway and tells every rank
    (one small broadcast per save), so each stops with the same :class:`DiskFullError` (its line printed by the
    command's error channel on every rank). A save written in the background (:class:`app.checkpoint.BackgroundSaves`)
    reports its failure at the next save, or at :meth:`wait_for_saves` at the end of ``fit``.

    It also takes ``precision: auto`` (the ImageNet recipes' setting): ``bf16-mixed`` on a GPU that computes bf16
    (sm80 and newer), ``16-mixed`` on an older one, else ``32-true`` (:func:`core.device.precision_for`; the plan
    says which); and it turns ``benchmark`` off under ``deterministic`` (:func:`resolve_benchmark`).
    """

    def __init__(self, *args: Any, precision: PRECISION_INPUT | Literal["auto"] | None = None, **kwargs: Any) -> None:
        """Lightning's arguments; ``precision`` also ``auto``."""
        if precision == AUTO:
            precision = auto_precision(on_cuda(kwargs.get("accelerator", AUTO)))  # type: ignore[assignment]
        kwargs["benchmark"] = resolve_benchmark(kwargs.get("benchmark"), kwargs.get("deterministic"))
        super().__init__(*args, precision=precision, **kwargs)

    def save_checkpoint(
        self, filepath: PATH, weights_only: bool | None = None, storage_options: Any | None = None
    ) -> None:
        if self.model is None:  # Lightning's own check, which the body below replaces
            return super().save_checkpoint(filepath, weights_only, storage_options)
        # Lightning's Trainer.save_checkpoint, with the failure of rank 0's save shared after the barrier
        with self.profiler.profile("save_checkpoint"):
            checkpoint = dump_checkpoint(self, weights_only)
            self._together("Trainer.save_checkpoint", self.strategy.save_checkpoint, checkpoint, filepath,
                           storage_options=storage_options)  # fmt: skip

    def wait_for_saves(self) -> None:
        """Every rank waits until rank 0's save in flight (written in the background) is on disk, and stops with its
        failure as :meth:`save_checkpoint` does: after it, any rank may read every checkpoint of the run."""
        wait = getattr(self.strategy.checkpoint_io, "wait", None)
        self._together("Trainer.wait_for_saves", wait if self.is_global_zero and callable(wait) else lambda: None)

    def _together(self, name: str, action: Any, *args: Any, **kwargs: Any) -> None:
        """``action`` (rank 0's write), then every rank meets at a barrier and stops with its :class:`DiskFullError`."""
        failure = None
        try:
            action(*args, **kwargs)
        except DiskFullError as err:
            failure = str(err)
        self.strategy.barrier(name)
        failure = self.strategy.broadcast(failure, src=0)
        if failure:
            raise DiskFullError(failure)
