"""Stragglers: which rank the others wait for, and whether it waits for its data.

In a DDP job every rank leaves each step's gradient all-reduce at the same moment, so the wall time of a step is the
same on every rank and says nothing about who is slow: the slow rank's extra time shows up as the others' wait inside
the collective. What differs is the part of a step a rank spends on its own before it first waits for the others:
the gap between its previous step and this one (its wait for the next batch, and Lightning's loop between steps:
:func:`~app.callbacks.throughput.gap_parts`) and its forward pass (the start of the step to the start of backward).
So each rank times these with host timers on every step (no device read, no collective) and sums them; on logging
steps (``core.logging_steps``) one small all-gather of a CPU tensor over gloo brings every rank's sums to every rank,
and the logger gets:

- ``perf/step_time_max_ms``: the slowest rank's own time per step, in ms;
- ``perf/step_time_skew``: the slowest rank's own time over the median rank's (1.0 = balanced);
- ``perf/slowest_rank``: that rank;
- ``perf/data_wait_frac``: the share of the slowest rank's whole step spent waiting for its next batch;
- per rank: ``perf/rank_step_time_ms/rank<R>`` and ``perf/rank_data_wait_frac/rank<R>`` (one series per rank in
  TensorBoard and W&B).

At the end of ``fit`` every rank's totals are gathered into a per-rank table (rank, host, mean own step time, and
the shares of its whole step spent waiting for data and in Lightning's loop) that names the slowest rank, by how
much, and the likely fix; rank 0 prints it as the last block of the training summary
(:class:`~app.callbacks.summary.TrainingSummary`), or alone when the run has no summary.

Not seen: a rank slower in its forward/backward compute itself (a throttled GPU) hides inside the all-reduce, where
the others wait for it; on a GPU the host timers measure when the host is held up (data, a full launch queue), not
the device's own time.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from app.callbacks.throughput import gap_parts
from app.collectives import gloo_side_group
from core.logging_steps import is_logging_step

DATA_BOUND = 0.5  # a slowest rank waiting for data this share of its own time is input-bound
SUMS = ("own", "data", "loop", "step", "steps")  # what each rank adds up per step (seconds; steps: a count)


class Stragglers(Callback):
    """Per-rank step and data-wait timing, gathered on logging steps; a table naming the slowest rank at the end."""

    def __init__(self) -> None:
        self._window = [0.0] * len(SUMS)  # SUMS since the last logging step
        self._total = [0.0] * len(SUMS)
        self._last_end: float | None = None
        self._start = self._data = self._loop = 0.0
        self._forward_start: float | None = None
        self._backward_end: float | None = None
        self._hook: Any = None
        self._group: Any = None
        self.table: list[dict[str, Any]] = []

    def _distributed(self, trainer: Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # the gap before an epoch's first batch is epoch bookkeeping, not data waiting

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the start of the wrapper's forward, before DDP's first collective of the step (its buffer broadcast)
        model = trainer.strategy.model
        if self._distributed(trainer) and isinstance(model, torch.nn.Module):
            self._hook = model.register_forward_pre_hook(self._forward_starts)

    def _forward_starts(self, module: Any, args: Any) -> None:
        if self._forward_start is None:
            self._forward_start = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._start = time.perf_counter()
        self._data, self._loop = gap_parts(trainer, self._start, self._last_end)
        self._forward_start = self._backward_end = None

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._backward_end = time.perf_counter()  # the step's gradient all-reduce is done (the last micro-batch's)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        end = time.perf_counter()
        before = (self._forward_start or self._start) - self._start  # the step's start hooks
        after = end - (self._backward_end or end)  # optimizer step and the end hooks
        own = self._data + self._loop + before + after
        step = self._data + self._loop + end - self._start
        for acc in (self._window, self._total):
            for k, value in enumerate((own, self._data, self._loop, step, 1)):
                acc[k] += value
        self._last_end = end
        if not self._distributed(trainer) or not is_logging_step(trainer):
            return
        ranks = self._gather(trainer, self._window)
        self._window = [0.0] * len(SUMS)
        pl_module.log_dict(metrics(ranks), on_step=True, on_epoch=False)  # the same values on every rank

    def _gather(self, trainer: Trainer, sums: list) -> list[tuple[float, float, float, float]]:
        """Every rank's (own ms per step, data-wait share of its whole step, loop share, whole step ms), by rank:
        one all-gather of len(SUMS) floats per rank."""
        mine = torch.tensor([float(x) for x in sums], dtype=torch.float64)  # CPU: no device queue involved
        out = [torch.zeros_like(mine) for _ in range(trainer.world_size)]
        dist.all_gather(out, mine, group=self._gloo())
        ranks = []
        for own, data, loop, step, n in (t.tolist() for t in out):
            ms = (own / n * 1000) if n else 0.0
            ranks.append(
                (ms, data / step if step > 0 else 0.0, loop / step if step > 0 else 0.0, step / n * 1000 if n else 0.0)
            )
        return ranks

    def _gloo(self) -> Any:
        """Every rank gets here at the same, first, logging step, so the side group's collective lines up."""
        self._group = gloo_side_group(self._group)
        return self._group

    def collect(self, trainer: Trainer) -> list[dict[str, Any]]:
        """The per-rank table of this fit, gathered once (two collectives over gloo: every rank must call it)."""
        if self.table or not self._distributed(trainer) or not self._total[-1]:
            return self.table
        ranks = self._gather(trainer, self._total)
        hosts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self._gloo())
        self.table = [
            {"rank": r, "host": h, "step_ms": ms, "data_wait_frac": data, "loop_frac": loop, "whole_step_ms": whole}
            for r, (h, (ms, data, loop, whole)) in enumerate(zip(hosts, ranks, strict=True))
        ]
        self._group = None  # the run's end must not keep a group alive (app.launch.group)
        return self.table

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the summary (a callback before this one) has collected and printed the table already; without one, alone
        shown = any(getattr(cb, "shows_stragglers", False) for cb in trainer.callbacks)
        if self.collect(trainer) and not shown:
            rank_zero_info(render(self.table))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._group = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __deepcopy__(self, memo: dict) -> Stragglers:
        return Stragglers()


def metrics(ranks: list[tuple[float, ...]]) -> dict[str, float]:
    """The logged figures for every rank's (own ms per step, data-wait share, ...)."""
    times = [r[0] for r in ranks]
    slowest = max(range(len(ranks)), key=lambda r: times[r])
    median = statistics.median(times)
    out = {
        "perf/step_time_max_ms": times[slowest],
        "perf/step_time_skew": times[slowest] / median if median > 0 else 1.0,
        "perf/slowest_rank": float(slowest),
        "perf/data_wait_frac": ranks[slowest][1],
    }
    for r, (ms, frac, *_) in enumerate(ranks):
        out[f"perf/rank_step_time_ms/rank{r}"] = ms
        out[f"perf/rank_data_wait_frac/rank{r}"] = frac
    return out


def render(table: list[dict[str, Any]]) -> str:
    """The per-rank table and the line that names the slowest rank with the likely fix."""
    rows = [f"  {'rank':>4}  {'host':<16} {'own ms':>8}  {'step ms':>8}  {'data wait':>9}  {'loop':>5}"]
    rows += [
        f"  {t['rank']:>4}  {t['host']:<16} {t['step_ms']:>8.1f}  {t['whole_step_ms']:>8.1f}  "
        f"{t['data_wait_frac']:>9.1%}  {t['loop_frac']:>5.1%}"
        for t in table
    ]
    slowest = max(table, key=lambda t: t["step_ms"])
    median = statistics.median(t["step_ms"] for t in table)
    ratio = slowest["step_ms"] / median if median > 0 else 1.0
    own_share = slowest["data_wait_frac"] * slowest["whole_step_ms"] / max(slowest["step_ms"], 1e-9)
    if own_share >= DATA_BOUND:
        fix = "raise --data.num_workers or check that node's disk"
    else:
        fix = "check that node's load (other jobs, CPU or GPU throttling, `nvidia-smi -q -d PERFORMANCE`)"
    verdict = (
        f"rank {slowest['rank']} (host {slowest['host']}) is the slowest: {ratio:.2f}x the median step; "
        f"{slowest['data_wait_frac']:.0%} of its step waits for data: {fix}"
    )
    head = (
        "Per-rank step time (own: each rank's part of a step, the others wait: data wait, Lightning's loop, "
        "optimizer step, hooks; data wait and loop: shares of the whole step)"
    )
    return "\n".join([head, *rows, verdict if ratio >= 1.1 else "ranks balanced (slowest within 10% of the median)"])
