"""Reproducer, outside the app: DDP on a gloo process group made under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` segfaults.

Two local processes form a gloo group, then each wraps a ``Linear`` in ``DistributedDataParallel``. With torch
2.14.1 (CPU) and ``DETAIL`` both die with SIGSEGV in the DDP constructor (``c10d::Logger::set_env_variables``, called
by ``set_construction_data_and_log``): under ``DETAIL`` the group's gloo backend is a ``ProcessGroupWrapper``, which
that function casts to ``ProcessGroupGloo`` to read its thread count. With ``OFF`` or ``INFO``, or with
``--own-group`` (DDP given a gloo group made with the level lowered to ``INFO``: the app's workaround,
``app.callbacks.debug_checks``), both print ``ddp ok``.

Usage: ``TORCH_DISTRIBUTED_DEBUG=DETAIL python tools/gloo_detail_ddp.py [--own-group]``; exit status 0 when both
ranks built DDP, 1 when one died.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, port: int, own_group: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = None
    if own_group:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.INFO)
        group = dist.new_group(backend="gloo")
        dist.set_debug_level(level)
    backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    print(f"rank {rank}: level {dist.get_debug_level().name}, world group's gloo backend {backend}", flush=True)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=group)
    print(f"rank {rank}: ddp ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(work, args=(port, "--own-group" in sys.argv), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException as err:
        print(f"torch {torch.__version__}: {err}", flush=True)
        sys.exit(1)
