"""SLURM preemption handled at a step boundary, on every rank at once."""

from __future__ import annotations

import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment

from app.lightning_private import cluster_environment, should_accumulate, slurm_requeue
from app.resilience import agree


class SLURMRequeue(Callback):
    """Saves the ``hpc_ckpt`` and requeues the job after SIGUSR1, at the next training step boundary.

    Lightning's own handler saves the checkpoint inside the signal handler, wherever each rank happens to be. Under DDP
    one rank then enters the checkpoint's collectives while another waits in backward's all-reduce, and the job hangs
    until the process-group timeout (seen here; Lightning#21406). So this handler only records the signal; after each
    training batch the ranks agree whether any of them got it (``app.resilience.agree``: one asynchronous all-reduce
    per step for all such checks, started when the step starts and read when it ends), and then all of them run
    Lightning's own routine together: finalize the loggers, write ``hpc_ckpt_N.ckpt``, and rank 0 calls
    ``scontrol requeue``. The requeued job resumes from that checkpoint as before. Does nothing outside SLURM.
    """

    def __init__(self) -> None:
        self._signum: int | None = None
        self._previous = None
        self._requested = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        env = cluster_environment(trainer)
        if stage != "fit" or not isinstance(env, SLURMEnvironment) or not env.auto_requeue:
            return
        self._signum, self._requested = env.requeue_signal, False
        # Installed before the Trainer registers its handlers: Lightning keeps an existing handler for this signal
        # instead of adding its own (_SignalConnector.register_signal_handlers).
        self._previous = signal.signal(self._signum, self._record)
        agree.watch(trainer, "slurm_requeue", lambda: self._requested)

    def _record(self, signum, frame) -> None:
        self._requested = True

    def on_train_batch_start(self, trainer: Trainer, *args) -> None:
        if self._signum is not None:
            agree.start(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if self._signum is None:
            return
        # inside an accumulation the requeue waits for its optimizer step (a partial accumulation is not in checkpoints)
        if agree.any_rank(trainer, "slurm_requeue") and not should_accumulate(trainer):
            self._requested = False
            slurm_requeue(trainer, self._signum)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(trainer, finished=False)  # a peer may be gone: nothing in flight is waited for

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore(trainer)

    def _restore(self, trainer: Trainer, finished: bool = True) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous or signal.SIG_DFL)
            agree.unwatch(trainer, "slurm_requeue", finished)
            self._signum = None
