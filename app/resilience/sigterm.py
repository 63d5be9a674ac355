"""SIGTERM (``kill``, ``scancel``, a Kubernetes eviction, torchrun passing it on) and Ctrl-C handled at a step
boundary."""

from __future__ import annotations

import os
import signal
import threading

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from app.checkpoint import last_checkpoint_of
from app.lightning_private import restore_sigterm_broadcast, should_accumulate, skip_sigterm_broadcast
from app.resilience import agree
from core.errors import say

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT  # 130: the same for Ctrl-C (SIGINT)


def _say(trainer: Trainer | None, message: str) -> None:
    """One line on this rank's stderr, with the rank when there are several (a Ctrl-C reaches every rank)."""
    world = trainer.world_size if trainer is not None else 1
    rank = f"[rank {trainer.global_rank}] " if trainer is not None and world > 1 else ""
    say(f"{rank}{message}")


class SIGTERMCheckpoint(Callback):
    """After SIGTERM, every rank finishes its training step, ``last.ckpt`` is written and the job exits with 143.

    Lightning's own SIGTERM handler broadcasts a tensor from inside the signal handler, i.e. wherever each rank happens
    to be: a rank interrupted in backward's all-reduce and one in the data loader then pair up the wrong collectives
    and the DDP job hangs (the same failure as the in-handler SLURM checkpoint, see :class:`SLURMRequeue`); and it
    saves nothing. This handler only records the signal. After each training batch the ranks agree whether any of them
    got it (``app.resilience.agree``: an asynchronous all-reduce started when the step starts and read when it ends,
    shared with the other such checks, so a signal to one rank stops all of them at the same step), then all of them
    save the checkpoint
    together and raise Lightning's ``SIGTERMException`` (a ``SystemExit``: loggers are finalized, no traceback).
    ``--ckpt_path last`` resumes at the same global step.

    The exit status is 143 (128 + SIGTERM), the status of a process ended by SIGTERM: the job was interrupted, not
    finished, so a retry policy or a shell script treats it as such. The checkpoint is ``last.ckpt`` in the
    ``ModelCheckpoint`` folder (``<default_root_dir>/last.ckpt`` without one). A signal that arrives during
    validation is acted on after it, at the next training step. With ``accumulate_grad_batches`` > 1 the stop waits
    for the optimizer step that ends the accumulation (the gradients of a partial accumulation are not in
    checkpoints), so the resumed run continues exactly.

    Ctrl-C (SIGINT, which a terminal sends to every process of the job) does the same with exit status 130, and
    every rank says so in one line; a second Ctrl-C stops at once without saving (the last checkpoint stays as it was).
    """

    def __init__(self) -> None:
        self._requested = False
        self._interrupts = 0  # Ctrl-C presses seen
        self._previous = None
        self._previous_sigint = None
        self._watching = False
        self._trainer: Trainer | None = None

    def _install(self, trainer: Trainer) -> None:
        # Lightning registers its handler after on_fit_start (Trainer._run), so it is replaced here, once it exists
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) != self._record:
            self._requested, self._previous = False, signal.signal(signal.SIGTERM, self._record)
            self._interrupts, self._previous_sigint = 0, signal.signal(signal.SIGINT, self._interrupt)
            self._trainer = trainer
            agree.watch(trainer, "sigterm", lambda: self._requested)
            self._watching = True
            # Lightning 2.6 also broadcasts rank 0's SIGTERM flag before every training batch and reads it on the
            # host: a blocking collective and a device sync per step. Its flag is set only by Lightning's handler,
            # which this one has just replaced, so the broadcast could only ever carry 0: off for this run.
            skip_sigterm_broadcast(trainer)

    def _record(self, signum, frame) -> None:
        self._requested = True

    def _interrupt(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts == 1:
            self._requested = True
            _say(self._trainer, "Ctrl-C: stopping at the end of this training step and saving a checkpoint "
                 "(Ctrl-C again stops at once, without saving).")  # fmt: skip
            return
        _say(self._trainer, "Ctrl-C again: stopping now without saving; the checkpoints on disk are as they were.")
        # ended by the signal itself (status 130 to the shell), whatever this process was doing; its loader workers
        # end with it (they watch their parent), and the other ranks got the same Ctrl-C from the terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    def _restore(self, trainer: Trainer, finished: bool = True) -> None:
        if signal.getsignal(signal.SIGTERM) == self._record:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
        if signal.getsignal(signal.SIGINT) == self._interrupt:
            signal.signal(signal.SIGINT, self._previous_sigint or signal.default_int_handler)
        # also when Lightning's teardown has already put back the handlers it found: the agreement's last all-reduce
        # must be waited for before the process group goes (an unwaited gloo work aborts the exiting interpreter)
        if self._watching:
            self._watching = False
            agree.unwatch(trainer, "sigterm", finished)
            restore_sigterm_broadcast(trainer)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)

    def on_train_batch_start(self, trainer: Trainer, *args) -> None:
        if self._watching:
            agree.start(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if not self._watching or not agree.any_rank(trainer, "sigterm"):
            return
        if should_accumulate(trainer):
            return  # inside an accumulation: the flag stays set, every rank stops after the same optimizer step
        ckpt, path = trainer.checkpoint_callback, last_checkpoint_of(trainer)
        if ckpt is not None:  # the file is ModelCheckpoint's own: its next save replaces it instead of writing last-v1
            ckpt.last_model_path = str(path)
        trainer.save_checkpoint(path)
        if self._interrupts:
            _say(
                trainer,
                f"Ctrl-C: saved {path} at global step {trainer.global_step}; exiting with status "
                f"{INTERRUPT_EXIT_CODE}. Resume with the same command plus `--ckpt_path last`.",
            )
            raise SIGTERMException(INTERRUPT_EXIT_CODE)
        rank_zero_info(
            f"SIGTERM: saved {path} at global step {trainer.global_step}; exiting with status {EXIT_CODE}. "
            "Resume with the same command plus `--ckpt_path last`."
        )
        raise SIGTERMException(EXIT_CODE)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # after our own stop every rank is at the same step; after another error a peer may be gone
        self._restore(trainer, finished=isinstance(exception, SIGTERMException))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore(trainer)
