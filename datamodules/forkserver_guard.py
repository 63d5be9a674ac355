"""Imported by the DataLoader workers' forkserver only (``datamodules.base.FORKSERVER_PRELOAD``): the forkserver ends
when the training process that started it dies.

Python's forkserver is meant to exit when its parent closes the pipe to it, yet the forkserver of a rank killed by
SIGKILL (the OOM killer, a lost-rank restart) was seen living on as an orphan with its workers, each process holding
the loader's imports (about 0.5 GB here), and keeping the job's output open. Linux's ``PR_SET_PDEATHSIG`` makes the
kernel send it SIGKILL when its parent dies; its workers then see their parent gone (torch's worker watchdog) and end
within seconds. Nothing in multiprocessing or torch offers this, hence by hand. A no-op elsewhere than Linux.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


_die_with_parent()
