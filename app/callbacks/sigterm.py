"""SIGTERM (``kill``, ``scancel``, a Kubernetes eviction, torchrun passing it on) handled at a step boundary."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from app.callbacks import agree

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM


class SIGTERMCheckpoint(Callback):
    """After SIGTERM, every rank finishes its training step, ``last.ckpt`` is written and the job exits with 143.

    Lightning's own SIGTERM handler broadcasts a tensor from inside the signal handler, i.e. wherever each rank happens
    to be: a rank interrupted in backward's all-reduce and one in the data loader then pair up the wrong collectives
    and the DDP job hangs (the same failure as the in-handler SLURM checkpoint, see :class:`SLURMRequeue`); and it
    saves nothing. This handler only records the signal. After each training batch the ranks agree whether any of them
    got it (one tiny all-reduce per step, shared with the other such checks in ``app.callbacks.agree``, so a signal
    to one rank stops all of them), then all of them save the checkpoint
    together and raise Lightning's ``SIGTERMException`` (a ``SystemExit``: loggers are finalized, no traceback).
    ``--ckpt_path last`` resumes at the same global step.

    The exit status is 143 (128 + SIGTERM), the status of a process ended by SIGTERM: the job was interrupted, not
    finished, so a retry policy or a shell script treats it as such. The checkpoint is ``last.ckpt`` in the
    ``ModelCheckpoint`` folder (``<default_root_dir>/last.ckpt`` without one). A signal that arrives during
    validation is acted on after it, at the next training step.
    """

    def __init__(self) -> None:
        self._requested = False
        self._previous = None

    def _install(self, trainer: Trainer) -> None:
        # Lightning registers its handler after on_fit_start (Trainer._run), so it is replaced here, once it exists
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) != self._record:
            self._requested, self._previous = False, signal.signal(signal.SIGTERM, self._record)
            agree.watch(trainer, "sigterm", lambda: self._requested)

    def _record(self, signum, frame) -> None:
        self._requested = True

    def _restore(self, trainer: Trainer) -> None:
        if signal.getsignal(signal.SIGTERM) == self._record:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            agree.unwatch(trainer, "sigterm")

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if not agree.any_rank(trainer, "sigterm", self._requested):
            return
        ckpt = trainer.checkpoint_callback
        folder = Path(ckpt.dirpath if ckpt is not None and ckpt.dirpath else trainer.default_root_dir)
        path = folder / f"{getattr(ckpt, 'CHECKPOINT_NAME_LAST', None) or 'last'}.ckpt"
        if ckpt is not None:  # the file is ModelCheckpoint's own: its next save replaces it instead of writing last-v1
            ckpt.last_model_path = str(path)
        trainer.save_checkpoint(path)
        rank_zero_info(
            f"SIGTERM: saved {path} at global step {trainer.global_step}; exiting with status {EXIT_CODE}. "
            "Resume with the same command plus `--ckpt_path last`."
        )
        raise SIGTERMException(EXIT_CODE)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore(trainer)
