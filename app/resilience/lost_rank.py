"""When a collective fails because a rank died, the survivors say which rank was lost and exit."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from app.lightning_private import ChildProcessObserver, child_processes, on_child_death
from app.resilience.faults import LostRankError, Restarting, loader_worker_died
from app.resilience.hang_watch import hosts_of
from core.env import detect, node_name
from core.errors import UserError, report

# what gloo (and c10d around it) says when the other end of a collective is gone or silent
PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|timed out|timeout|connection refused", re.IGNORECASE)


def torch_message(exception: BaseException) -> str:
    """The first sentence of torch's message, without gloo's source location: ``Read error [10.0.0.7]:41234: ...``."""
    first = (str(exception).strip().splitlines() or [type(exception).__name__])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first).split(". ")[0][:240]


# One report per process: the main thread and Lightning's poller thread may both find the lost rank. Process-wide by
# nature (Lightning's poller is patched for the whole process, watch_the_start_up), and a lock cannot be a callback's
# own: the callback must stay picklable and deep-copyable, as Lightning expects of callbacks.
_REPORTING = threading.Lock()
CHILD_EXIT_S = 2.0  # how long rank 0 waits for a local rank whose connection broke to show its exit status


class LostRank(Callback):
    """Turns "Connection closed by peer [10.0.0.7]:41234" into "lost rank 1 of 2", then ends this rank.

    torch reports a dead peer only by its socket address, or as a collective timeout naming nobody. On such an
    error every surviving rank checks in at the job's rendezvous store (a separate TCP service, still up unless its
    host died) and waits ``roll_call_s`` seconds for the others: the ranks that do not check in are the lost ones.
    When the store itself is gone, its host (rank 0, or the torchrun agent) is the one lost; under Lightning's own
    launcher, rank 0 started the other local ranks and reads their exit status directly. The rank then exits
    with status 1 and that message instead of a traceback, after finalizing its loggers; nothing is left waiting.
    Under ``torchrun --max-restarts K`` with a restart left, the line says instead that torchrun restarts the worker
    group (which resumes from the newest ``last.ckpt``, see ``app.loggers.resume_torchrun_job``): not an error yet.

    With NCCL a dead peer usually makes the survivors block until the process-group timeout (``--launch.timeout``),
    after which torch's watchdog ends the process itself; this callback reports whatever reaches Python.

    Under Lightning's own launcher a thread of rank 0 also polls the other local ranks every 5 s and SIGKILLs rank 0
    when one has died, saying only ``Child process with PID ... terminated`` at INFO level. When it gets there first
    (the rank died while rank 0 was not in a collective), this callback's report is what it prints instead, and rank
    0 exits with status 1 as it would here; when this callback gets there first, the poller stands down.
    """

    def __init__(self, roll_call_s: float = 5.0) -> None:
        self.roll_call_s = roll_call_s
        self._failures = 0
        self._reported = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for thread in threading.enumerate():  # Lightning's observer, started by its launcher on rank 0
            if isinstance(thread, ChildProcessObserver):
                on_child_death(thread, lambda observer=thread: self._child_died(trainer, observer))

    def _child_died(self, trainer: Trainer, observer: threading.Thread) -> None:
        """Lightning's poller found a dead local rank: report it as a lost rank, stop the others, exit 1."""
        with _REPORTING:
            if self._reported:  # the main thread is already reporting it and ending the process
                return
            self._reported = True
        lost, how = self._dead_children(trainer) or ([], "a local rank ended")
        report(self._error(lost, trainer.world_size, how, trainer.global_rank, None))
        for proc in child_processes(observer):
            if proc.poll() is None:
                proc.kill()
        os._exit(1)  # from this thread: the main thread may be blocked in a collective with the dead rank

    @staticmethod
    def _error(lost: list[int], world: int, how: str, rank: int, torch_says: str | None) -> LostRankError:
        names = ", ".join(map(str, lost)) if lost else "unknown"
        torch_says = f" torch: {torch_says}." if torch_says else ""
        launch = detect()
        restart, most = launch.restart_count, launch.max_restarts
        if restart < most:  # torchrun --max-restarts: the agent stops the survivors and starts the group again
            return Restarting(
                f"lost rank {names} of {world} ({how}); rank {rank} stops too and torchrun restarts the worker group "
                f"(restart {restart + 1} of {most}), which resumes from the newest last.ckpt of this run.{torch_says}"
            )
        used_up = f" torchrun has no restart left ({most} of {most} used), so the job fails." if most else ""
        return LostRankError(
            f"lost rank {names} of {world} ({how}); rank {rank} stops too.{used_up}{torch_says} "
            "Fix: look at the lost rank's log and exit status (out of memory? killed by the scheduler? node down?), "
            "then resume the job with `--ckpt_path last`."
        )

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return
        if isinstance(exception, (SystemExit, UserError)):  # this rank ends with its own line (a full disk: every rank)
            with _REPORTING:  # so Lightning's poller, seeing the other ranks end first, reports no lost rank
                self._reported = True
            return
        if not PEER_GONE.search(str(exception)) or loader_worker_died(exception):  # its own line (the command's)
            return
        with _REPORTING:
            if self._reported:  # Lightning's poller is reporting it and ending the process
                return
            self._reported = True
        rank, world = trainer.global_rank, trainer.world_size
        if threading.current_thread() is threading.main_thread():
            # this rank is stopping anyway; a SIGTERM now (torchrun's agent stops the survivors) would run Lightning's
            # handler, restored by SIGTERMCheckpoint, whose broadcast on the broken group fails inside the roll call
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._failures += 1
        lost, how = self._dead_children(trainer) or self._roll_call(rank, world)
        torch_says = torch_message(exception)
        for logger in trainer.loggers:
            logger.finalize("failed")
        # the wrapper (DDP's reducer) holds the process group: released as the skipped teardown would, so that the
        # group ends before the interpreter finalizes (app.launch.group)
        trainer.strategy.model = pl_module
        # raised here, ending the process (its line and the SLURM requeue are the command's error channel's): the rest
        # of Lightning's teardown would only touch the broken process group
        raise self._error(lost, world, how, rank, torch_says)

    @staticmethod
    def _dead_children(trainer: Trainer) -> tuple[list[int], str] | None:
        """Under Lightning's own launcher, rank 0 started the other local ranks and sees how they ended."""
        procs = getattr(trainer.strategy.launcher, "procs", None) or []
        # the dead rank's sockets close while it exits, a moment before its exit status can be read: wait for it
        deadline = time.monotonic() + (CHILD_EXIT_S if procs else 0)
        while not (dead := {i + 1: p.poll() for i, p in enumerate(procs) if p.poll() not in (None, 0)}):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        codes = ", ".join(f"rank {r} pid {procs[r - 1].pid} exit {code}" for r, code in dead.items())
        return list(dead), (
            f"on {node_name()}: {codes}; a negative exit is the signal that ended it, -9 = SIGKILL, e.g. the OOM killer"
        )

    def _roll_call(self, rank: int, world: int) -> tuple[list[int], str]:
        prefix = f"app/lost_rank/{self._failures}"
        try:
            store = dist.distributed_c10d._get_default_store()  # private, but the only handle on the job's store
            store.set(f"{prefix}/{rank}", str(os.getpid()))
            deadline = time.monotonic() + self.roll_call_s
            while True:
                missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception:  # the store's host is gone: torch's own store under Lightning's launcher is rank 0's
            launch = detect()
            where = f"{launch.master_addr or '?'}:{launch.master_port or '?'}"
            if launch.agent_store:
                return [], f"the rendezvous store at {where} (the torchrun agent) no longer answers"
            return [0], f"its process hosted the rendezvous store at {where}, which no longer answers"
        if not missing:
            return [], "every rank answered the roll call, so the failure was in the network between them"
        hosts = sorted(set(hosts_of(missing).values()))  # the node to keep the job off (sbatch --exclude)
        where = f"on {', '.join(hosts)}: " if hosts else ""
        # with the hang watch on (app.resilience.hang_watch: its timeouts are inside the collective's), a rank alive but
        # stuck is named by it before any collective times out; it does not see a rank before that rank's watch
        # started (rank 0 still in its DataModule's setup), nor a run with it off
        return missing, (
            f"{where}no answer within {self.roll_call_s:g} s after the collective failed: it died, or it is alive but "
            "stuck where the hang watch does not look (before its own watch started, or with "
            "`--launch.hang_timeout 0`)"
        )


def watch_the_start_up() -> None:
    """A local rank that dies while the job starts (before :class:`LostRank` exists on rank 0: the process group's
    rendezvous, the data set-up) is named in the app's one line, and rank 0 exits 1.

    Lightning's launcher polls its children (``_ChildProcessObserver``) and, for a dead one, SIGKILLs every rank and
    itself: the job ends with status 137 and no line of the app's. Its observer has no hook, so its
    ``_terminate_all`` is replaced here for the whole process (:meth:`LostRank.setup` takes over each run's observer
    once training is set up). Idempotent; installed by :func:`app.command.main`.
    """
    on_child_death(ChildProcessObserver, _died_starting)


def _died_starting(observer) -> None:
    # process-wide, as the patch of Lightning's observer class is: one start-up report per process (its flag is the
    # class's, under the module's lock)
    with _REPORTING:
        reported, LostRank._starting_reported = getattr(LostRank, "_starting_reported", False), True
    if reported:
        return
    procs = child_processes(observer)
    dead = {i + 1: p for i, p in enumerate(procs) if p.poll() not in (None, 0)}
    how = ", ".join(f"rank {r} pid {p.pid} exit {p.returncode}" for r, p in dead.items())
    how += " while the job was starting, before training; a negative exit is the signal that ended it, -9 = SIGKILL"
    report(LostRank._error(list(dead), len(procs) + 1, how, 0, None))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    os._exit(1)  # from the observer's thread: the main thread may wait in the rendezvous for the dead rank
