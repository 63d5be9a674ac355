"""``--trainer.sync_batchnorm true`` on every accelerator: BatchNorm normalises with the statistics of the global batch.

Lightning's ``sync_batchnorm`` converts BatchNorm layers to ``torch.nn.SyncBatchNorm``, which refuses CPU tensors
(and DDP refuses it in a CPU module). :class:`SyncBatchNormPlugin` is the ``LayerSync`` the app gives the Trainer
instead: on a CPU run it converts to :class:`CPUSyncBatchNorm`, on a GPU run to torch's ``SyncBatchNorm`` as
Lightning does. ``app.command`` adds it whenever ``trainer.sync_batchnorm`` is true (:func:`with_sync_batchnorm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override


def _channel_sums(t: Tensor) -> Tensor:
    """Per-channel sum over every dimension but dim 1 (N, C, *)."""
    return t.sum(dim=[d for d in range(t.dim()) if d != 1])


def _per_channel(t: Tensor, like: Tensor) -> Tensor:
    """A (C,) tensor shaped to broadcast over ``like`` (N, C, *)."""
    return t.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    """torch's ``SyncBatchNorm`` function in plain tensor ops (its fused kernels exist for CUDA only)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)  # statistics of bf16 activations in fp32, as torch does
        xf = x.to(acc)
        channels = x.shape[1]
        count = torch.tensor([x.numel() // channels if channels else 0], dtype=acc)
        # one collective per layer: sums, sums of squares and counts packed (counts may differ between ranks)
        packed = torch.cat([_channel_sums(xf), _channel_sums(xf * xf), count.to(x.device)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        total, total_sq, n = packed[:channels], packed[channels:-1], packed[-1]
        mean = total / n
        var = (total_sq / n - mean * mean).clamp_(min=0)  # biased: what the batch is normalised by
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            # like torch: the running variance is the unbiased one of the global batch
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (n / (n - 1).clamp(min=1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group = group
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.to(acc), x)
        if bias is not None:
            y = y + _per_channel(bias.to(acc), x)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd, n = ctx.saved_tensors
        acc = mean.dtype
        dyf, xmu = dy.to(acc), x.to(acc) - _per_channel(mean, x)
        sum_dy, sum_dy_xmu = _channel_sums(dyf), _channel_sums(dyf * xmu)
        # the local sums: DDP (or the allreduce strategy) averages parameter gradients over the ranks
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # every element's input gradient depends on the whole global batch through mean and variance: the two
            # reductions are summed over the ranks, as torch's SyncBatchNorm backward does
            combined = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(combined, op=dist.ReduceOp.SUM, group=ctx.group)
            mean_dy, mean_dy_xmu = (combined / n).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_input = dyf - _per_channel(mean_dy, x) - xmu * _per_channel(invstd * invstd * mean_dy_xmu, x)
            grad_input = (grad_input * _per_channel(scale, x)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch over every rank of ``process_group``.

    In training with 2+ ranks, the per-channel sums, sums of squares and counts are all-reduced in the forward (one
    collective) and the two gradient reductions in the backward; otherwise (eval mode, one process) it is exactly
    BatchNorm. Written in plain tensor ops, so it runs wherever the tensors are (the app uses it on CPU). It is not a
    ``torch.nn.SyncBatchNorm``, which DDP refuses in a CPU module; its ``state_dict`` keys are BatchNorm's, so
    checkpoints load both ways.
    """

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group
        self.original: type[_BatchNorm] = nn.BatchNorm2d  # the class :meth:`revert` restores

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _world(self) -> int:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    @override
    def forward(self, input: Tensor) -> Tensor:
        if self._world() == 1:  # eval mode (running statistics) or a single process: plain BatchNorm
            return super().forward(input)
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as in BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum, self.process_group
        )

    @classmethod
    def convert(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """``module`` with every BatchNorm layer replaced by this class, holding the same parameter and buffer
        tensors (each stays on its device); like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``."""

        def make(bn: _BatchNorm) -> nn.Module:
            out = cls(
                bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group=process_group
            )
            out.original = type(bn)
            return out

        return _swap(module, lambda m: isinstance(m, _BatchNorm) and not isinstance(m, cls), make)

    @classmethod
    def revert(cls, module: nn.Module) -> nn.Module:
        """``module`` with this class's layers turned back into the BatchNorm classes they were converted from."""

        def make(bn: CPUSyncBatchNorm) -> nn.Module:
            return bn.original(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)

        return _swap(module, lambda m: isinstance(m, cls), make)


def _swap(module: nn.Module, match: Any, make: Any) -> nn.Module:
    """``module`` with each submodule matching ``match`` replaced by ``make(it)``, which takes over its tensors."""
    out = module
    if match(module):
        out = make(module)
        with torch.no_grad():
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _swap(child, match, make))
    return out


def _runs_on_cpu(model: nn.Module) -> bool:
    trainer = getattr(model, "_trainer", None)  # a LightningModule in fit: not moved to its device yet
    if trainer is not None:
        return trainer.strategy.root_device.type == "cpu"
    return next(model.parameters(), torch.empty(0)).device.type == "cpu"


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's ``TorchSyncBatchNorm`` that converts to :class:`CPUSyncBatchNorm` when the run is on CPU.

    A subclass, so the Trainer accepts it together with ``sync_batchnorm=True``; the strategies that apply a layer
    sync (``ddp``, ``allreduce``, ``ddp_mp``: DDPStrategy's ``setup``) convert before placing the model on its
    devices, and revert when fit ends.
    """

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        return CPUSyncBatchNorm.convert(model) if _runs_on_cpu(model) else super().apply(model)

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return super().revert(CPUSyncBatchNorm.revert(model))


def with_sync_batchnorm(plugins: Any) -> list[Any]:
    """The Trainer's ``plugins`` (None, one or a list) plus :class:`SyncBatchNormPlugin`: what
    ``trainer.sync_batchnorm: true`` needs so that Lightning does not pick its own ``TorchSyncBatchNorm``."""
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]
    return [*plugins, SyncBatchNormPlugin()]
