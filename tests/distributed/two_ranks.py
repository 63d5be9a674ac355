"""Two real gloo processes for a test that must stay cheap: rank 0 is the test's own process, rank 1 a fork of it.

A fork starts in well under a second (it imports nothing again; a spawned process spent 7-17 s importing Lightning
here), and rank 0 running in the test's process lets `make mutation` see which functions the test calls (mutmut maps
tests to functions in its own process only, and times them by their call). The fork is made before any process group
exists and uses one intra-op thread, as DataLoader workers do.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2


def _exit_with(parent: int) -> None:
    """Ends this process once its parent is gone (a killed test would leave it waiting for rank 0)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _rank(target: Callable[[int], Any], rank: int, store: str) -> Any:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        return target(rank)
    finally:
        dist.destroy_process_group()


def _forked(target: Callable[[int], Any], store: str, out: str, parent: int) -> None:
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    torch.save(_rank(target, 1, store), out)


def two_ranks(target: Callable[[int], Any], tmp: Path) -> list[Any]:
    """``target(rank)`` on both ranks of a fresh gloo group; returns both results (rank 1's through ``torch.save``)."""
    if dist.is_initialized():  # a one-process group an earlier in-process fit left (Lightning never destroys one)
        dist.destroy_process_group()
    store, out = str(tmp / "store"), str(tmp / "rank1.pt")
    other = multiprocessing.get_context("fork").Process(target=_forked, args=(target, store, out, os.getpid()))
    other.start()
    try:
        mine = _rank(target, 0, store)
    finally:
        other.join(timeout=120)
    assert other.exitcode == 0, f"rank 1 exited with {other.exitcode}"
    return [mine, torch.load(out, weights_only=False)]
