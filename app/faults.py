"""Faults: failures of a job that are no mistake in its configuration (a rank or a loader worker lost, ranks that
never met), which a launcher with restarts left heals (:class:`Fault`); and one of them said in one line instead of a
traceback: a DataLoader worker that died.

torch raises ``RuntimeError: DataLoader worker (pid(s) N) exited unexpectedly`` (or ``... is killed by signal:
Killed.`` when its SIGCHLD handler sees the death first) from deep inside the training loop, and Python prints 20 lines
of traceback that do not say why a worker dies. The usual reason is the kernel's out-of-memory killer (SIGKILL): each
worker holds its own copy of what the dataset touches, and its prefetched batches. :func:`loader_worker_died` turns it
into one line naming the rank, the worker's pid, how it ended and what to do (:class:`LoaderWorkerLost`); the rank then
exits 1, so a launcher with restarts left (torchrun, ``--launch.max_restarts``) restarts the group, which resumes from
its last checkpoint.
"""

from __future__ import annotations

import re
import signal
import time
from types import TracebackType

from lightning.fabric.utilities.rank_zero import rank_zero_only

from core.env import node_name
from core.errors import UserError


class Fault(UserError):
    """A failure of the job itself, not of its configuration: after its line, a SLURM job with requeues left goes back
    in the queue (:class:`app.launch.requeue.Requeue`, called by the command's error channel)."""


class LoaderWorkerLost(Fault):
    """A DataLoader worker of this rank died."""

    help = "loader-worker-lost"


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
    rank = rank_zero_only.rank if hasattr(rank_zero_only, "rank") else 0
    return LoaderWorkerLost(
        f"rank {rank} (host {node_name()}): its DataLoader worker (pid {where}) {how}; {cause}. The last checkpoint "
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
