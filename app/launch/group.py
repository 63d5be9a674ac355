"""The end of a job's process group: destroyed on every rank before the interpreter exits.

Why by hand: Lightning destroys the default group at exit only for NCCL (the ``atexit`` hook of
``_init_dist_connection``). A gloo group left alive keeps its worker threads, and such a thread can still hold the
last reference to a finished collective's work: ``ProcessGroupGloo::runLoop`` releases it only after ``wait()`` has
returned to Python. If Python is already finalizing when that thread frees the work's tensors, the thread blocks on
the GIL, CPython ends it with ``pthread_exit`` inside a C++ destructor, and libstdc++ calls ``std::terminate``:
"terminate called without an active exception", SIGABRT, after a run that completed (found with a core dump of
such a run: ``gdb -batch -ex "thread apply all bt" python core``).

``destroy_process_group`` drops torch's own references to the group. Lightning's teardown has already released the
DDP wrapper by then, so the C++ group is destroyed at once: its destructor joins the worker threads (torch releases
the GIL for it), and a thread still freeing a work finishes while Python is fully alive. After this call no
``pt_gloo_runloop`` thread is left in a finished ``cli.py fit`` (checked in ``/proc/self/task``).

A rank that ends on an error (a lost rank, a user mistake said on every rank) holds the same threads, one of them the
failed collective's work: the same abort, after the error line, turned exit status 1 into SIGABRT. There the group is
ended too, but within a bound: the destructor waits for collectives still in flight, and one waiting on a peer that
is alive but stuck would hold the exit up until its timeout. Past the bound the process ends at once
(``os._exit``, after flushing its output), as a rank whose job failed may.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import traceback
from collections.abc import Iterator

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


def end_process_group() -> None:
    """Destroys the default process group (and every subgroup) if one exists; a no-op otherwise.

    Call it once the job's last collective is done, on every rank: it does not communicate, so ranks may reach it
    at different times. On the error path, :func:`end_process_group_on_error`: a collective still waiting on a peer
    would hold the shutdown up until the collective times out.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


ERROR_BOUND_S = 10.0  # how long a rank that ends on an error waits for its group's collectives in flight


def end_process_group_on_error(exiting: SystemExit, bound_s: float = ERROR_BOUND_S) -> None:
    """Ends the process group of a rank that is exiting after an error, waiting at most ``bound_s``.

    The DDP wrapper holds the group: the strategy lets it go in Lightning's teardown, or ``app.callbacks.LostRank``
    where it skips that teardown; the frames of the error (its traceback, and those of the exceptions it chains: the
    failed collective's, inside the wrapper) are cleared here, or the group would outlive ``destroy_process_group``.
    The group's collectives that failed with the lost peer end at once; one still waiting on a live but stuck peer
    would wait for its timeout: past ``bound_s`` the process exits with the status of ``exiting`` without finalizing
    the interpreter (the only way out while a C++ destructor holds the group; its output is flushed first).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    error: BaseException | None = exiting
    while error is not None:
        traceback.clear_frames(error.__traceback__)  # frames still running (this one, the caller's) are kept
        error = error.__cause__ or error.__context__
    gc.collect()  # the wrapper sits in reference cycles (modules, hooks)
    code = exiting.code
    ender = threading.Thread(target=end_process_group, name="end-process-group", daemon=True)
    ender.start()
    ender.join(bound_s)
    if ender.is_alive():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 1)


@contextlib.contextmanager
def process_group_ended() -> Iterator[None]:
    """Ends the process group when the block finishes its work, stops on SIGTERM, or ends on an error.

    SIGTERM (``app.callbacks.SIGTERMCheckpoint``) stops every rank at the same step after a completed save, so no
    collective is in flight and the exit status 143 must not turn into a SIGABRT either. A rank that ends on an error
    (``SystemExit`` from the command's error channel) may have a collective in flight with a lost peer: its group is
    ended within :data:`ERROR_BOUND_S` (:func:`end_process_group_on_error`). Any other exception (a bug, with its
    traceback) leaves the group alone.
    """
    try:
        yield
    except SIGTERMException:
        end_process_group()
        raise
    except SystemExit as exiting:
        end_process_group_on_error(exiting)
        raise
    end_process_group()
