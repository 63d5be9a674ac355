"""The manual all-reduce's averaging (``AllReduceStrategy``), called directly on 2 real gloo processes (this test's
process and a fork of it: ``tests.distributed.two_ranks``).

Every variant (one call per parameter, buckets, one bucket, overlap hooks, fp16 and bf16 on the wire) runs two
optimizer steps of two micro-batches each: the first backward accumulates only, the second is the armed one that
averages. The ranks' gradients differ. Buckets hold at most 16 float32 values: two buckets are exactly full, one
parameter is bigger than a bucket, one gets no gradient on any rank in step 0 and one only on rank 1, and one is
frozen. Each rank must end with exactly the average this test computes from both ranks' gradients (fp32: the exact
mean; fp16/bf16: the halves rounded to the wire dtype, summed there), and ``None`` where no rank had a gradient; the
buckets must be cut at the cap, and the overlap variants must launch them during backward.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from app.strategies import AllReduceStrategy
from tests.distributed.two_ranks import WORLD, two_ranks

pytestmark = pytest.mark.distributed  # a real 2-process gloo group (about a second)
SIZES = [5, 2, 40, 10, 6, 5, 4, 7]  # values per parameter
CAP_MB = 64 / 2**20  # 64 bytes: 16 float32 values
NO_GRAD, RANK1_ONLY = 3, 4  # in step 0: the parameter no rank has a gradient for, the one only rank 1 has
# the buckets (values per parameter), last parameters first: two exactly at the cap, one parameter over it alone
LAYOUTS = {0: [[n] for n in reversed(SIZES)], CAP_MB: [[7, 4, 5], [6, 10], [40], [2, 5]], 1.0: [SIZES[::-1]]}
WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = {  # the registered variants' arguments, with the small bucket cap
    "allreduce_per_param": {"bucket_cap_mb": 0},
    "allreduce": {"bucket_cap_mb": CAP_MB},
    "allreduce_1mib": {"bucket_cap_mb": 1.0},  # all in one bucket
    "allreduce_overlap": {"bucket_cap_mb": CAP_MB, "overlap": True},
    "allreduce_fp16": {"bucket_cap_mb": CAP_MB, "compression": "fp16"},
    "allreduce_bf16": {"bucket_cap_mb": CAP_MB, "compression": "bf16"},
    "allreduce_overlap_fp16": {"bucket_cap_mb": CAP_MB, "overlap": True, "compression": "fp16"},
}
STEPS = 2
# buckets launched while backward ran, per step: none without overlap; with it, in order up to the first bucket still
# missing a gradient (step 0: the second bucket holds the parameter no rank has a gradient for), all of them in step 1
LAUNCHED = {False: [0, 0], True: [1, 4]}


class Net(nn.Module):
    """Parameters of the sizes above, a frozen one, and a float and an integer buffer; each rank starts different."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(rank)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES])
        self.frozen = nn.Parameter(torch.randn(3, generator=gen), requires_grad=False)
        self.register_buffer("running", torch.randn(4, generator=gen))
        self.register_buffer("count", torch.tensor(10 + rank))


def coefficients(rank: int, step: int, micro: int) -> list[torch.Tensor | None]:
    """The gradient one micro-batch's backward gives each parameter on ``rank`` (the loss is sum(coef * param))."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    coefs: list[torch.Tensor | None] = [torch.randn(n, generator=gen) for n in SIZES]
    if step == 0:
        coefs[NO_GRAD] = None
        if rank == 0:
            coefs[RANK1_ONLY] = None
    return coefs


def gradient(rank: int, step: int) -> list[torch.Tensor | None]:
    """A rank's accumulated gradients of one step (both micro-batches), as autograd accumulates them."""
    first, second = coefficients(rank, step, 0), coefficients(rank, step, 1)
    return [None if a is None else a + b for a, b in zip(first, second, strict=True)]


def expected(step: int, compression: str) -> list[torch.Tensor | None]:
    """The average every rank must hold: the ranks' gradients (zeros where missing) pre-divided by the world, cast
    for the wire, summed there, copied back into float32; ``None`` where no rank had one."""
    wire = WIRE[compression]
    per_rank = [gradient(rank, step) for rank in range(WORLD)]
    out: list[torch.Tensor | None] = []
    for index, size in enumerate(SIZES):
        grads = [g[index] for g in per_rank]
        if all(g is None for g in grads):
            out.append(None)
            continue
        halves = [(torch.zeros(size) if g is None else g) / WORLD for g in grads]
        total = sum(h.to(wire) for h in halves) if wire is not None else sum(halves)
        out.append(total.to(torch.float32))
    return out


def _backward(net: Net, coefs: list[torch.Tensor | None]) -> None:
    loss = sum((c * p).sum() for c, p in zip(coefs, net.weights, strict=True) if c is not None)
    loss.backward()


def _variant(rank: int, name: str) -> dict:
    """One variant on this rank: weights after the start's broadcast, each step's averaged gradients, the buffers."""
    env = LightningEnvironment()
    env.set_world_size(WORLD)
    env.set_global_rank(rank)
    strategy = AllReduceStrategy(cluster_environment=env, **VARIANTS[name])
    net = Net(rank)
    strategy.model = net
    strategy.configure_ddp()
    facts: dict = {"start": [p.detach().clone() for p in net.parameters()], "grads": []}
    facts["layout"] = [[p.numel() for p in bucket] for bucket in strategy._buckets]
    for step in range(STEPS):
        for p in net.parameters():
            p.grad = None  # zero_grad(set_to_none=True)
        _backward(net, coefficients(rank, step, 0))  # a micro-batch that only accumulates: no hook may launch
        strategy._armed, strategy._averaged = True, False  # the closure before the optimizer step
        _backward(net, coefficients(rank, step, 1))
        strategy._armed = False
        facts.setdefault("launched_in_backward", []).append(strategy._next)
        strategy.average_gradients()
        facts["grads"].append([None if p.grad is None else p.grad.clone() for p in net.weights])
        facts.setdefault("frozen_grad", net.frozen.grad)
    with torch.no_grad():
        net.running.add_(rank)  # the ranks' statistics now differ: the float one is averaged, the integer is rank 0's
        net.count.add_(rank)
    strategy.sync_buffers()
    facts["buffers"] = {"running": net.running.clone(), "count": net.count.clone()}
    AllReduceStrategy(cluster_environment=env).sync_buffers()  # no model yet: nothing to do, nothing fails
    return facts


def _variants(rank: int) -> dict:
    return {name: _variant(rank, name) for name in VARIANTS}


def _same(grads: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> bool:
    if [g is None for g in grads] != [r is None for r in reference]:
        return False
    pairs = zip(grads, reference, strict=True)
    return all(g is None or (g.dtype == torch.float32 and torch.equal(g, r)) for g, r in pairs)


def test_every_variant_averages_exactly_on_both_ranks(tmp_path):
    """One job for every variant, run inside the test itself (`make mutation` times and maps tests by their call)."""
    ranks = two_ranks(_variants, tmp_path)
    start = [p.detach() for p in Net(0).parameters()]
    first = Net(0).running  # every rank's after the broadcast; rank 1 then adds 1
    running = (first + (first + 1)) / WORLD
    wrong = []
    for name, init_args in VARIANTS.items():
        compression = init_args.get("compression", "none")
        for rank, facts in enumerate(ranks):
            for step in range(STEPS):
                grads, reference = facts[name]["grads"][step], expected(step, compression)
                if not _same(grads, reference):
                    wrong.append(f"{name} rank {rank} step {step}: {grads} instead of {reference}")
            if facts[name]["frozen_grad"] is not None:
                wrong.append(f"{name} rank {rank}: the frozen parameter got a gradient")
            if not all(torch.equal(a, b) for a, b in zip(facts[name]["start"], start, strict=True)):
                wrong.append(f"{name} rank {rank}: the start did not broadcast rank 0's weights")
            if facts[name]["layout"] != LAYOUTS[init_args["bucket_cap_mb"]]:
                wrong.append(f"{name} rank {rank}: buckets {facts[name]['layout']}")
            launched = facts[name]["launched_in_backward"]
            if launched != LAUNCHED[bool(init_args.get("overlap"))]:
                wrong.append(f"{name} rank {rank}: buckets launched during backward, per step: {launched}")
            buffers = facts[name]["buffers"]
            if not torch.equal(buffers["running"], running) or buffers["count"].item() != 10:
                wrong.append(f"{name} rank {rank}: buffers {buffers}, not the float mean and rank 0's integer")
    assert not wrong, "\n".join(wrong)


def test_the_reference_can_tell_the_variants_apart():
    """The comparisons above can fail: the wire's rounding shows in the reference, and a rank's own gradients (no
    average) or the sum (no division) differ from it."""
    exact = expected(0, "none")
    for compression in ("fp16", "bf16"):
        assert not _same(expected(0, compression), exact)
    assert not _same(gradient(1, 0), exact)
    assert not _same([None if g is None else g * WORLD for g in exact], exact)


def test_buffers_are_left_alone_without_a_process_group():
    strategy = AllReduceStrategy()
    strategy.model = net = Net(0)
    before = {k: v.clone() for k, v in net.named_buffers()}
    strategy.sync_buffers()
    assert all(torch.equal(v, before[k]) for k, v in net.named_buffers())
