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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


def end_process_group() -> None:
    """Destroys the default process group (and every subgroup) if one exists; a no-op otherwise.

    Call it once the job's last collective is done, on every rank: it does not communicate, so ranks may reach it
    at different times. Not on the error path of a lost rank: a collective still waiting on a dead peer would hold
    the shutdown up until the collective times out.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group_ended() -> Iterator[None]:
    """Ends the process group when the block finishes its work, or stops on SIGTERM.

    SIGTERM (``app.callbacks.SIGTERMCheckpoint``) stops every rank at the same step after a completed save, so no
    collective is in flight and the exit status 143 must not turn into a SIGABRT either. Any other exception leaves
    the group alone (a rank may have died with a collective still waiting on it).
    """
    try:
        yield
    except SIGTERMException:
        end_process_group()
        raise
    end_process_group()
