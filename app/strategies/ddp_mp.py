"""``ddp_mp``: model parallel inside each process, DDP across processes.

Each process owns ``devices_per_process`` consecutive GPUs: process ``r`` of a node uses GPUs ``k*r .. k*r+k-1``,
so ``trainer.devices`` counts processes, not GPUs. The network is cut into ``k`` stages of about equal parameter
count, in registration order (which is execution order for the zoo's sequential and ResNet-style models); a
forward pre-hook moves each stage's input to its device. DDP wraps the multi-device module with
``device_ids=None``, the supported form for a module spanning several devices. On CPU all stages sit on the CPU,
so the same code path runs in CI.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

log = logging.getLogger(__name__)


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def split_units(model: nn.Module, min_units: int) -> tuple[nn.Module, list[nn.Module]]:
    """The blocks to place on stages, in order, and the module whose output leaves the last stage.

    Descends while a module has a single child holding state (e.g. LightningModule -> net), then expands the
    largest block (a ResNet stage into its residual blocks) until there are at least ``min_units`` blocks and none
    holds more than ``1 / min_units`` of the parameters, or it cannot be divided further.
    Modules without parameters or buffers are not placed: they run wherever their input is.
    """
    parent = model
    while True:
        stateful = [c for c in parent.children() if _has_state(c)]
        if len(stateful) == 1 and list(stateful[0].children()):
            parent = stateful[0]
            continue
        break
    units = [c for c in parent.children() if _has_state(c)] or [parent]
    total = sum(p.numel() for p in parent.parameters())
    while True:  # expand the largest block while there are too few blocks or it alone outweighs a stage
        largest = max(units, key=lambda m: sum(p.numel() for p in m.parameters()))
        children = [c for c in largest.children() if _has_state(c)]
        too_big = sum(p.numel() for p in largest.parameters()) * min_units > total
        if not children or (len(units) >= min_units and not too_big):
            return parent, units
        index = units.index(largest)
        units[index : index + 1] = children


def balance(units: list[nn.Module], stages: int) -> list[int]:
    """Stage index of each unit: contiguous groups with about ``total / stages`` parameters each."""
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    total, done, out = max(sum(sizes), 1), 0, []
    for size in sizes:
        out.append(min(stages - 1, int(stages * (done + size / 2) / total)))
        done += size
    return out


class DDPModelParallelStrategy(DDPStrategy):
    """DDP over processes, each holding its network split into ``devices_per_process`` stages.

    Args:
        devices_per_process: GPUs per process (stages). On CPU every stage is the CPU.
        **kwargs: DDPStrategy's arguments (``find_unused_parameters``, ``bucket_cap_mb``, ``timeout``, ...).
    """

    strategy_name = "ddp_mp"

    def __init__(self, devices_per_process: int = 2, **kwargs: Any) -> None:
        if devices_per_process < 1:
            raise ValueError(f"ddp_mp: devices_per_process must be >= 1, got {devices_per_process}")
        super().__init__(**kwargs)
        self.devices_per_process = devices_per_process
        self._handles: list[Any] = []

    @property
    def stage_devices(self) -> list[torch.device]:
        """This process's devices, one per stage."""
        first = super().root_device
        if first.type == "cpu":
            return [first] * self.devices_per_process
        k = self.devices_per_process
        start = k * self.local_rank + (self.parallel_devices[0].index or 0)
        count = torch.cuda.device_count()
        if start + k > count:
            raise RuntimeError(
                f"ddp_mp: process {self.local_rank} needs GPUs {start}..{start + k - 1} "
                f"(devices_per_process={k} x {len(self.parallel_devices)} processes per node) but only {count} "
                f"are visible. Set trainer.devices to the number of processes per node (GPUs / {k}), "
                "or lower strategy.init_args.devices_per_process."
            )
        return [torch.device("cuda", start + i) for i in range(k)]

    @property
    @override
    def root_device(self) -> torch.device:
        return self.stage_devices[0]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        devices = self.stage_devices
        self.model.to(devices[0])  # metrics and parameter-free parts stay with the first stage
        parent, units = split_units(self.model, len(devices))
        stages = balance(units, len(devices))
        for handle in self._handles:  # setup runs again for validate/test on the same model
            handle.remove()
        self._handles = []
        for unit, stage in zip(units, stages, strict=True):
            unit.to(devices[stage])
            self._handles.append(unit.register_forward_pre_hook(self._move_inputs(devices[stage]), with_kwargs=True))
        # the logits come back to the first device, where the labels and the metrics are
        self._handles.append(parent.register_forward_hook(lambda _m, _i, out: move_data_to_device(out, devices[0])))
        plan = ", ".join(f"{type(u).__name__}->stage {s} ({devices[s]})" for u, s in zip(units, stages, strict=True))
        rank_zero_info(f"ddp_mp: {len(devices)} stages per process: {plan}")

    @staticmethod
    def _move_inputs(device: torch.device) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return move_data_to_device(args, device), move_data_to_device(kwargs, device)

        return hook

    @override
    def determine_ddp_device_ids(self) -> list[int] | None:
        return None  # a module spanning several devices must be wrapped with device_ids=None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # torch's load_state_dict already puts each state on its parameter's device; Lightning's default would
        # then move everything to root_device, away from the parameters of the later stages.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "ddp_mp", cls, description="DDP across processes, model split over 2 devices per process", override=True
        )
