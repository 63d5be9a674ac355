"""The collectives self-test: the PyTorch distributed tutorial's point-to-point and collective primitives with known
values, on the process group that exists (``tools.parity``'s torchrun job runs it once)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def check_collectives(device: torch.device) -> dict[str, bool]:
    """The tutorial's point-to-point and collective primitives with known values (rank r contributes r + 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.full((4,), float(rank + 1), device=device)
    total = sum(range(1, world + 1))
    ok: dict[str, bool] = {}
    peer = (rank + 1) % world  # a ring: send to the next rank, receive from the previous one
    got = torch.zeros(4, device=device)
    if rank % 2 == 0:
        dist.send(mine, dst=peer)
        dist.recv(got, src=(rank - 1) % world)
    else:
        dist.recv(got, src=(rank - 1) % world)
        dist.send(mine, dst=peer)
    ok["send_recv"] = bool((got == (rank - 1) % world + 1).all())
    got = torch.zeros(4, device=device)
    requests = [dist.isend(mine, dst=peer), dist.irecv(got, src=(rank - 1) % world)]
    for request in requests:
        request.wait()
    ok["isend_irecv"] = bool((got == (rank - 1) % world + 1).all())
    value = mine.clone()
    dist.broadcast(value, src=0)
    ok["broadcast"] = bool((value == 1).all())
    part = torch.zeros(1, device=device)
    chunks = [torch.full((1,), 10.0 * (r + 1), device=device) for r in range(world)] if rank == 0 else None
    dist.scatter(part, scatter_list=chunks, src=0)
    ok["scatter"] = part.item() == 10.0 * (rank + 1)
    gathered = [torch.zeros(4, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, gather_list=gathered, dst=0)
    ok["gather"] = rank != 0 or all(bool((g == r + 1).all()) for r, g in enumerate(gathered))
    value = mine.clone()
    dist.reduce(value, dst=0, op=dist.ReduceOp.SUM)
    ok["reduce"] = rank != 0 or bool((value == total).all())
    value = mine.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    ok["all_reduce"] = bool((value == total).all())
    everyone = [torch.zeros(4, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine)
    ok["all_gather"] = all(bool((t == r + 1).all()) for r, t in enumerate(everyone))
    results = [None] * world
    dist.all_gather_object(results, ok)
    return {name: all(r[name] for r in results) for name in ok}


def gloo_side_group(made: Any) -> Any:
    """The group for a small CPU collective of a callback: None (the default group) when that is gloo, else ``made``
    or, the first time, a gloo group made for it (every rank calls this at the same point: new_group is collective)."""
    if dist.get_backend() == "gloo":
        return None
    return made if made is not None else dist.new_group(backend="gloo")
