"""``allreduce``: data parallel without the DDP wrapper, as the classic PyTorch tutorial does it. Launcher, process
group, environments, the injected ``DistributedSampler`` (and ``set_epoch``) and rank-0 checkpoints are DDPStrategy's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from core.errors import InvalidValue, with_link
from core.layout import Layout

log = logging.getLogger(__name__)

_WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class AllReduceStrategy(DDPStrategy):
    """Broadcasts rank 0's weights at start, then averages gradients with ``all_reduce``, once per optimizer step.

    The average happens inside the optimizer-step closure, at the end of the last micro-batch's backward (once per
    step with ``accumulate_grad_batches``), before AMP's ``unscale_``, clipping and ``scaler.step``, so an inf/NaN on
    one rank reaches every rank and all GradScalers skip the same steps. As with DDP, ``on_after_backward`` hooks see
    the averaged gradients, in every variant, and an edit made there applies on top of the average. A missing
    gradient is sent as zeros by every rank (the
    ranks issue the same collectives and never hang); if no rank has one, it stays None, as under DDP.

    Args:
        bucket_cap_mb: 0 = one ``all_reduce`` per parameter (the tutorial's ``average_gradients``); > 0 = gradients
            flattened into buckets of at most this many MiB, one call per bucket.
        overlap: launch each bucket's all-reduce asynchronously from gradient hooks while backward still runs.
        compression: ``fp16`` or ``bf16`` casts the gradients for the wire (halves the traffic, loses precision).
        **kwargs: DDPStrategy's arguments (``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

    strategy_name = "allreduce"

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        overlap: bool = False,
        compression: Literal["none", "fp16", "bf16"] = "none",
        **kwargs: Any,
    ) -> None:
        if problems := self.config_problems({"bucket_cap_mb": bucket_cap_mb, "compression": compression}):
            raise InvalidValue(problems[0])
        super().__init__(**kwargs)
        self.bucket_cap_mb, self.overlap, self.compression = bucket_cap_mb, overlap, compression
        self._buckets: list[list[nn.Parameter]] = []
        self._armed = False  # hooks launch all-reduces only during the closure that precedes an optimizer step
        self._arrived: list[int] = []  # per bucket: gradients ready in this backward (overlap)
        self._next = 0  # the next bucket to launch
        self._pending: list[tuple[Any, Callable[[], None]]] = []  # (work, write-back) of launched buckets
        self._hooks: list[Any] = []
        self._has_grad: list[bool] = []  # per launched parameter: did this rank have a gradient
        self._had_grad: Tensor | None = None  # per parameter, after the last bucket: > 0 where any rank had one
        self._averaged = False  # the armed backward has averaged its gradients

    @staticmethod
    def config_problems(init_args: Any) -> list[str]:
        """The mistakes in these arguments, each with its fix (the preflight asks before the strategy is built)."""
        problems, bucket_cap_mb = [], init_args.get("bucket_cap_mb", 25.0)
        if isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb < 0:
            problems.append(
                f"allreduce: bucket_cap_mb must be >= 0 (0 = one call per parameter), got {bucket_cap_mb}. Fix: "
                "--trainer.strategy.bucket_cap_mb 25 (the default), or 0 for one all_reduce per parameter."
            )
        if (compression := init_args.get("compression", "none")) not in _WIRE_DTYPES:
            problems.append(
                f"allreduce: compression must be one of {', '.join(_WIRE_DTYPES)}, got {compression!r}. Fix: "
                "--trainer.strategy.compression none (or fp16, bf16)."
            )
        return [with_link(problem, InvalidValue.help) for problem in problems]

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: its constructor would broadcast rank 0's state, so we do that here.
        assert self.model is not None
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._buckets = self._make_buckets(params)
        self._arrived = [0] * len(self._buckets)
        log.debug(f"{type(self).__name__}: {len(params)} parameters in {len(self._buckets)} buckets")
        if self.overlap:
            for index, bucket in enumerate(self._buckets):
                for param in bucket:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready(index, bucket)))

    def _make_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Reverse parameter order (gradients of the last layers arrive first), cut at ``bucket_cap_mb``."""
        if not params:
            return []
        if self.bucket_cap_mb == 0:
            return [[p] for p in reversed(params)]
        cap = self.bucket_cap_mb * 2**20
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for param in reversed(params):
            nbytes = param.numel() * param.element_size()
            if buckets[-1] and (size + nbytes > cap or param.device != buckets[-1][0].device):
                buckets.append([])
                size = 0
            buckets[-1].append(param)
            size += nbytes
        return buckets

    def _on_grad_ready(self, index: int, bucket: list[nn.Parameter]) -> Callable[[Tensor], None]:
        def hook(_param: Tensor) -> None:
            if not self._armed or self._averaged:
                return
            self._arrived[index] += 1
            # DDP's rule: launch strictly in bucket order, so every rank issues the same sequence of collectives
            while self._next < len(self._buckets) and self._arrived[self._next] == len(self._buckets[self._next]):
                self._pending.append(self._launch(self._buckets[self._next]))
                self._next += 1

        return hook

    def _launch(self, bucket: list[nn.Parameter]) -> tuple[Any, Callable[[], None]]:
        """Starts the asynchronous SUM of one bucket's gradients; a missing gradient is sent as zeros.

        Returns the work handle and the function that turns the sum into the average inside ``param.grad``. The
        last bucket also carries one number per parameter, 1/world where this rank had a gradient: summed, 0 means
        no rank had one (so no extra collective tells the ranks which gradients exist).
        """
        world, wire = self.world_size, _WIRE_DTYPES[self.compression]
        self._has_grad.extend(p.grad is not None for p in bucket)
        for param in bucket:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        last = self._next == len(self._buckets) - 1
        if len(bucket) == 1 and wire is None and not last:  # the tutorial's average_gradients: in place, then divide
            grad = bucket[0].grad
            return dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True), lambda: grad.div_(world)
        # pre-divide (as DDP does): an fp16 sum over many ranks overflows later
        parts = [p.grad.reshape(-1) for p in bucket]
        if last:
            like = {"dtype": parts[0].dtype, "device": parts[0].device}
            has = self._has_grad
            parts.append(torch.ones(len(has), **like) if all(has) else torch.tensor(has, **like))
        payload = torch.cat(parts).div_(world)
        payload = payload.to(wire) if wire is not None else payload
        work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, async_op=True)

        def finish() -> None:
            sizes = [p.numel() for p in bucket]
            chunks = payload.split([*sizes, payload.numel() - sum(sizes)])
            for param, chunk in zip(bucket, chunks, strict=False):
                param.grad.copy_(chunk.view_as(param))
            if last:
                self._had_grad = chunks[-1]

        return work, finish

    def average_gradients(self) -> None:
        """Launches the buckets the hooks have not launched yet, in order, waits for all, then restores ``None`` for
        parameters that had no gradient on any rank (the last bucket carried that), so optimizers treat them as DDP
        would."""
        while self._next < len(self._buckets):
            self._pending.append(self._launch(self._buckets[self._next]))
            self._next += 1
        for work, finish in self._pending:
            work.wait()
            finish()
        if not all(self._has_grad) and self._had_grad is not None:
            # Only a rank that lacked a gradient reads the sums (a host read): where it had every one, every sum is
            # at least its own 1/world and nothing can change, so the common step reads nothing off the device.
            params = [p for bucket in self._buckets for p in bucket]
            for param, total in zip(params, self._had_grad.tolist(), strict=True):
                if total == 0:
                    param.grad = None
        self._pending, self._next, self._has_grad, self._had_grad = [], 0, [], None
        self._arrived = [0] * len(self._buckets)
        self._averaged = True

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._armed and closure_loss.requires_grad:
            # Average when the autograd engine finishes this backward, as DDP's reducer does: before Lightning calls
            # on_after_backward. Averaging after it would drop edits made there in the overlap variant (its buckets
            # were copied during backward) and keep them in the others.
            closure_loss.register_hook(self._average_when_backward_ends)

    def _average_when_backward_ends(self, grad: Tensor) -> Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self.average_gradients)
        return grad

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Lightning runs this closure (training_step + backward) only for the micro-batch that ends an accumulation
        # window, and the precision plugin runs it before unscale/clip/step: the one right spot to average.
        def closure_then_average() -> Any:
            self._armed, self._averaged = True, False
            try:
                result = closure()
            finally:
                self._armed = False
            if not self._averaged:  # backward was skipped on this rank (training_step returned None): still take part
                self.average_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def sync_buffers(self, module: torch.nn.Module | None = None) -> None:
        """Makes buffers (BatchNorm running statistics) equal on all ranks: floats averaged, others from rank 0; of the
        model, or of ``module`` (the EMA callback's average, which takes them from its own rank at each update)."""
        module = self.model if module is None else module
        if module is None or not dist.is_available() or not dist.is_initialized():
            return
        with torch.no_grad():
            for buffer in module.buffers():
                if torch.is_floating_point(buffer):
                    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                    buffer.div_(self.world_size)
                else:
                    dist.broadcast(buffer, src=0)

    on_validation_start = on_test_start = sync_buffers  # evaluate the same BatchNorm statistics on every rank

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # every rank builds the checkpoint (rank 0 writes it), so this collective is entered by all ranks
        self.sync_buffers()
        return super().lightning_module_state_dict()

    @override
    def teardown(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        super().teardown()

    @classmethod
    def layout(cls, devices: int | None, num_nodes: int = 1, compression: str = "none", **init_args: Any) -> Layout:
        """One process per device; exact parity in fp32, close with fp16 on the wire (bf16: not compared)."""
        parity = {"none": "exact", "fp16": "close"}.get(compression)
        return Layout(
            processes_per_node=devices, parity=parity, fp16_parity=compression == "none", averages_by_hand=True
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        variants = {
            "allreduce": ({}, "gradients averaged by all_reduce in 25 MiB buckets after backward (no DDP wrapper)"),
            "allreduce_per_param": ({"bucket_cap_mb": 0}, "one all_reduce per parameter (the PyTorch tutorial)"),
            # 5 MiB: communication must start early in backward to hide behind it; with 25 MiB a ResNet-18 (45 MB of
            # gradients) has two buckets, the second, bigger one sent when backward is over (bench/README.md)
            "allreduce_overlap": (
                {"overlap": True, "bucket_cap_mb": 5.0},
                "all_reduce of 5 MiB buckets launched from gradient hooks during backward",
            ),
            "allreduce_fp16": ({"compression": "fp16"}, "bucketed all_reduce with fp16 gradients on the wire"),
            "allreduce_bf16": ({"compression": "bf16"}, "bucketed all_reduce with bf16 gradients on the wire"),
        }
        for name, (init_args, description) in variants.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_args)
