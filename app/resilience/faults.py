"""Every kind of fault, in one list: failures of a job that are no mistake in its configuration (a rank or a loader
worker lost, a rank stuck, ranks that never met), which a launcher with restarts left heals.

A kind is a :class:`Fault` subclass with its section of docs/troubleshooting.md (``help``) and how it is found:
raised where its detector finds it (the hang watch's thread, the lost-rank callback), or named by its translator
(:meth:`Fault.named`) from an exception the app did not raise (torch's report of a dead DataLoader worker, c10d's
rendezvous timeout). :data:`KINDS` lists the app's kinds; :func:`named` asks their translators in turn, for the
command's one error channel. A new kind is one file: its class, its detector (a translator, or a callback that raises
it) and the callback a test injects it with, registered on import (:func:`register`;
tests/unit/made_up_fault.py), plus its section of docs/troubleshooting.md.

A DataLoader worker that died: torch raises ``RuntimeError: DataLoader worker (pid(s) N) exited unexpectedly`` (or
``... is killed by signal: Killed.`` when its SIGCHLD handler sees the death first) from deep inside the training
loop, and Python prints 20 lines of traceback that do not say why a worker dies. The usual reason is the kernel's
out-of-memory killer (SIGKILL): each worker holds its own copy of what the dataset touches, and its prefetched
batches. :func:`loader_worker_died` turns it into one line naming the rank, the worker's pid, how it ended and what to
do (:class:`LoaderWorkerLost`); the rank then exits 1, so a launcher with restarts left (torchrun,
``--launch.max_restarts``) restarts the group, which resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from core.env import detect, node_name
from core.errors import UserError
from core.network import main_address


class Fault(UserError):
    """A failure of the job itself, not of its configuration: after its line, a SLURM job with requeues left goes back
    in the queue (:class:`app.resilience.requeue.Requeue`, called by the command's error channel)."""

    @classmethod
    def named(cls, err: BaseException, plan: Any = None) -> Fault | None:
        """The translator: this kind for ``err``, an exception the app did not raise, else None (a kind raised where it
        is found keeps this). ``plan``: the run's :class:`app.launch.plan.Plan`, None before it exists."""
        return None


class HangError(Fault):
    """The job is stuck: rank 0 names the rank behind and where it is; every rank leaves
    (:mod:`app.resilience.hang_watch`)."""

    help = "hang-watch"


class LostRankError(Fault):
    """A rank of the job died or stopped answering; raised on the survivors, said in one line
    (:mod:`app.resilience.lost_rank`)."""

    help = "lost-rank"


class Restarting(LostRankError):
    """A rank was lost and torchrun restarts the worker group (a restart is left): said as what happens next."""

    help = None
    said_as = "torchrun"


class RendezvousTimeout(Fault):
    """The ranks did not all meet: which ranks of the plan are missing, and what to check."""

    help = "rendezvous-timeout"

    @classmethod
    def named(cls, err: BaseException, plan: Any = None) -> RendezvousTimeout | None:
        """c10d's rendezvous timeout, said with the ranks ``plan`` expected; any other error, and any without a plan,
        is not one."""
        if not isinstance(err, dist.DistError) or "imed out" not in str(err) or plan is None:
            return None
        return cls(_missing_ranks(err, plan))


class LoaderWorkerLost(Fault):
    """A DataLoader worker of this rank died."""

    help = "loader-worker-lost"

    @classmethod
    def named(cls, err: BaseException, plan: Any = None) -> LoaderWorkerLost | None:
        return loader_worker_died(err)


class NCCLError(Fault):
    """NCCL failed in a collective of this rank (a peer gone, the network, a mismatch): torch's first line, said with
    where to look next."""

    help = "nccl-error"

    @classmethod
    def named(cls, err: BaseException, plan: Any = None) -> NCCLError | None:
        """torch's ``DistBackendError`` (or any ``RuntimeError`` whose first line names NCCL), else None."""
        first = (str(err).strip().splitlines() or [""])[0]
        if not isinstance(err, dist.DistBackendError) and not (isinstance(err, RuntimeError) and "NCCL" in first):
            return None
        return cls(
            f"{this_rank()}: NCCL failed ({first[:300]}). The hang watch's or lost rank's line above, if any, names "
            "the rank behind or gone. Fix: rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET (NCCL's own log: "
            "interfaces, transports); the flight recorder's dumps are in <run dir>/nccl_trace and hang/."
        )


class OutOfMemory(UserError):
    """CUDA ran out of memory on this rank: no fault (a requeue would meet it again) but the batch, said with what to
    lower while the global batch stays."""

    help = "cuda-out-of-memory"


def out_of_memory(err: BaseException) -> OutOfMemory | None:
    """torch's ``OutOfMemoryError`` as one line with the fix, else None."""
    if not isinstance(err, torch.OutOfMemoryError):
        return None
    first = (str(err).strip().splitlines() or [""])[0].split(". Of the allocated")[0][:200]
    return OutOfMemory(
        f"{this_rank()}: CUDA out of memory ({first}). Fix, keeping the global batch: --data.global_batch_size with "
        "--trainer.accumulate_grad_batches 2 (half the batch per step), --trainer.precision bf16-mixed (16-mixed "
        "before Ampere), --model.channels_last true."
    )


def this_rank() -> str:
    """``rank R (host H)``: this process's global rank (Lightning's) and node."""
    return f"rank {getattr(rank_zero_only, 'rank', 0)} (host {node_name()})"


_DIED = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly|is killed by signal: (.+?)\.?$)"
)


def loader_worker_died(err: BaseException) -> LoaderWorkerLost | None:
    """The error for ``err`` when it is torch's report of a DataLoader worker that died, else None.

    Its death can also reach the loader before torch's own check, found then by the worker's exit code: as an
    ``EOFError`` of the result queue (one worker: it held the queue's only writing end), or as a
    ``ConnectionResetError`` / ``ConnectionRefusedError`` while the batch it had queued is unpacked (torch passes a
    batch's tensors as file descriptors, handed over by the sending worker's own thread, gone with it). Only an
    error raised through the DataLoader's iterator counts: a collective's broken connection is another fault."""
    found = _DIED.search(str(err)) if isinstance(err, RuntimeError) else None
    if found is None and not isinstance(err, (EOFError, ConnectionError)):
        return None
    codes = _exit_codes(err.__traceback__, wait_s=0 if found else 2.0)
    pids = [int(p) for p in re.findall(r"\d+", found.group(1))] if found else [p for p, c in codes.items() if c]
    if not pids:
        return None
    code = next((codes[p] for p in pids if codes.get(p) is not None), None)
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    elif code is not None:
        how = f"exited with status {code}"
    else:
        how = f"was killed by signal {found.group(2)}" if found and found.group(2) else "exited"
    if "SIGKILL" in how or "Killed" in how:
        cause = (
            "most often the kernel's out-of-memory killer: `dmesg | grep -i kill` on that node (SLURM: `sacct -j "
            "<job> -o JobID,MaxRSS,State`). Fix: fewer workers (--data.num_workers), a smaller batch "
            "(--data.batch_size), or more memory for the job"
        )
    else:
        cause = (
            "a crash in the worker (a decoder or a C extension of a transform) or a worker stopped from outside. "
            "Fix: rerun with --data.num_workers 0 to see the error in the training process itself"
        )
    where = ", ".join(str(p) for p in pids)
    return LoaderWorkerLost(
        f"{this_rank()}: its DataLoader worker (pid {where}) {how}; {cause}. The last checkpoint "
        "is intact (resume with --ckpt_path last; under torchrun or --launch.max_restarts the job restarts by itself)."
    )


def _exit_codes(tb: TracebackType | None, wait_s: float = 0.0) -> dict[int, int | None]:
    """The exit codes of the DataLoader's workers, read from the loader iterator in ``tb``'s frames.

    torch's message names the pid but not how the worker ended; its iterator (``self`` of the frame that raised)
    still holds the ``multiprocessing.Process`` of each worker, which has reaped it and knows. By hand: torch offers
    no other way to reach them. ``wait_s``: how long to wait for a dead worker's exit code to be known.
    """
    workers = []
    while tb is not None:
        workers += [w for w in getattr(tb.tb_frame.f_locals.get("self"), "_workers", None) or [] if w.pid is not None]
        tb = tb.tb_next
    deadline = time.monotonic() + wait_s
    while workers and all(w.exitcode is None for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {w.pid: w.exitcode for w in workers}


def _missing_ranks(err: Exception, plan: Any) -> str:
    launch = plan.launch
    world = launch.world_size if launch.launcher != "none" else plan.world_size
    rank = launch.rank if launch.launcher != "none" else launch.node_rank * (plan.devices or 1)
    now = detect()  # Lightning fills in MASTER_ADDR/PORT when the launcher did not
    address = f"{now.master_addr or main_address(launch)}:{now.master_port or launch.master_port or '?'}"
    torch_says = str(err).strip().splitlines()[0][:300]
    joined = re.search(r"(\d+)/(\d+) clients joined", torch_says)
    if rank == 0:
        count = f"only {joined.group(1)} of {joined.group(2)}" if joined else f"not all {world}"
        missing = f"rank 0 waited at {address} for the {world} ranks of the job; {count} arrived"
    else:
        missing = f"rank {rank} never reached rank 0 at {address}: rank 0 did not start, or is unreachable"
    layout = "\n".join(line for line in plan.render().splitlines() if line.startswith("    node"))
    wait = f"{plan.timeout:g} s (--launch.timeout)" if plan.timeout is not None else "the strategy's timeout"
    return (
        f"the ranks did not all meet within {wait}: {missing} (torch: {torch_says}).\n"
        f"Expected layout:\n{layout}\n"
        "Check that every node started its processes (`squeue`/`sacct`, or the torchrun/python command on each "
        "node), that all use the same MASTER_ADDR/MASTER_PORT, and that the port is reachable from every node."
    )


# The app's kinds, their translators asked in this order (a rendezvous timeout before a lost worker's reset connection)
KINDS: list[type[Fault]] = [RendezvousTimeout, LoaderWorkerLost, LostRankError, HangError, NCCLError]


def register(kind: type[Fault]) -> None:
    """Adds a kind of fault (its translator is asked after the app's); once, however often its module is imported."""
    if kind not in KINDS:
        KINDS.append(kind)


def unregister(kind: type[Fault]) -> None:
    if kind in KINDS:
        KINDS.remove(kind)


def named(err: BaseException, plan: Any = None) -> UserError | None:
    """What the user reads for ``err``: itself when it is a user mistake or a fault (any
    :class:`~core.errors.UserError`), else the first kind of :data:`KINDS` whose translator names it; None: a bug,
    which keeps its traceback."""
    if isinstance(err, UserError):
        return err
    if (oom := out_of_memory(err)) is not None:  # a mistake of the batch, not a fault: never requeued
        return oom
    return next((fault for kind in KINDS if (fault := kind.named(err, plan)) is not None), None)


@contextlib.contextmanager
def faults_named(plan: Any = None) -> Iterator[None]:
    """Raises the fault an exception of the block is (:func:`named`, with ``plan``) in its place; any other exception
    passes unchanged."""
    try:
        yield
    except Exception as err:
        fault = named(err, plan)
        if fault is None or fault is err:
            raise
        raise fault from None
