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
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from app.lightning_private import init_dist_connection
from core.errors import InvalidValue, UserError, with_link
from core.layout import Layout

log = logging.getLogger(__name__)


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def split_units(model: nn.Module, min_units: int) -> tuple[nn.Module, list[nn.Module]]:
    """The blocks to place on stages, in order, and the module whose output leaves the last stage.

    Descends while a module has a single child holding state (e.g. LightningModule -> net), then expands the
    largest ``nn.Sequential`` block (a ResNet stage into its residual blocks) until there are at least ``min_units``
    blocks and none holds more than ``1 / min_units`` of the parameters, or no block can be divided further.
    Only ``nn.Sequential`` is expanded, because only its forward is its children in order: any other module (a
    residual block adds its input to its output) may combine its children's tensors, so it stays on one device.
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
        divisible = [u for u in units if isinstance(u, nn.Sequential) and any(_has_state(c) for c in u.children())]
        if not divisible:
            return parent, units
        largest = max(divisible, key=lambda m: sum(p.numel() for p in m.parameters()))
        children = [c for c in largest.children() if _has_state(c)]
        biggest = max(sum(p.numel() for p in u.parameters()) for u in units)
        if len(units) >= min_units and biggest * min_units <= total:
            return parent, units
        index = units.index(largest)
        units[index : index + 1] = children


def balance(units: list[nn.Module], stages: int) -> list[int]:
    """Stage index of each unit: contiguous groups, every stage used (when there are enough units), the largest
    group's parameter count as small as possible (the linear partition problem, solved exactly)."""
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    n, k = len(sizes), min(stages, len(sizes))
    if k <= 1:
        return [0] * n
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # cost[j][i]: the smallest possible largest group when the first i units form j groups; cut[j][i]: its last cut
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for m in range(j - 1, i):
                worst = max(cost[j - 1][m], prefix[i] - prefix[m])
                if worst < cost[j][i]:
                    cost[j][i], cut[j][i] = worst, m
    out, i = [0] * n, n
    for j in range(k, 0, -1):
        m = cut[j][i]
        out[m:i] = [j - 1] * (i - m)
        i = m
    return out


DEVICES_PER_PROCESS = 2  # the default number of stages


class DDPModelParallelStrategy(DDPStrategy):
    """DDP over processes, each holding its network split into ``devices_per_process`` stages.

    Args:
        devices_per_process: GPUs per process (stages). On CPU every stage is the CPU.
        **kwargs: DDPStrategy's arguments (``find_unused_parameters``, ``bucket_cap_mb``, ``timeout``, ...).
    """

    strategy_name = "ddp_mp"

    def __init__(self, devices_per_process: int = DEVICES_PER_PROCESS, **kwargs: Any) -> None:
        if problems := self.config_problems({"devices_per_process": devices_per_process}):
            raise InvalidValue(problems[0])
        super().__init__(**kwargs)
        self.devices_per_process = devices_per_process
        self._handles: list[Any] = []

    @staticmethod
    def config_problems(init_args: Any) -> list[str]:
        """The mistakes in these arguments, each with its fix (the preflight asks before the strategy is built)."""
        count = init_args.get("devices_per_process", DEVICES_PER_PROCESS)
        if not isinstance(count, int) or count >= 1:
            return []
        return [
            with_link(
                f"ddp_mp: devices_per_process must be >= 1, got {count}. Fix: --trainer.strategy.devices_per_process "
                f"{DEVICES_PER_PROCESS} (the default), or the GPUs each process should split its model over.",
                InvalidValue.help,
            )
        ]

    @property
    def stage_devices(self) -> list[torch.device]:
        """This process's devices, one per stage."""
        first = super().root_device
        if first.type == "cpu":
            return [first] * self.devices_per_process
        k = self.devices_per_process
        start = k * self.local_rank + (self.parallel_devices[0].index or 0)
        count = torch.cuda.device_count()
        if start + k > count:  # the preflight refuses this before anything starts; here for Lightning scripts
            raise UserError(
                f"ddp_mp: process {self.local_rank} needs GPUs {start}..{start + k - 1} "
                f"(devices_per_process={k} x {len(self.parallel_devices)} processes per node) but only {count} "
                f"are visible. Fix: trainer.devices = the number of processes per node (GPUs / {k}), "
                "or a lower strategy.init_args.devices_per_process.",
                help="ddp-mp-gpus",
            )
        return [torch.device("cuda", start + i) for i in range(k)]

    @property
    @override
    def root_device(self) -> torch.device:
        return self.stage_devices[0]

    @property
    def process_group_device(self) -> torch.device | None:
        """The device the process group is bound to: none when this process spans several (``setup_distributed``)."""
        return self.root_device if self.devices_per_process == 1 else None

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
    def setup_distributed(self) -> None:
        if self.devices_per_process == 1 or self.root_device.type == "cpu":
            return super().setup_distributed()
        # Lightning passes device_id=root_device, which binds NCCL to the first stage's GPU: DDP's broadcast and
        # gradient all-reduce of the later stages' tensors would then be refused ("backend constrained to cuda:0").
        # Unbound, NCCL makes one communicator per device the tensors live on.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    @override
    def determine_ddp_device_ids(self) -> list[int] | None:
        return None  # a module spanning several devices must be wrapped with device_ids=None

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            # without device_ids NCCL guesses the GPU as rank % GPU count: another process's GPU under ddp_mp
            dist.barrier(device_ids=[self.root_device.index])
        else:
            super().barrier(*args, **kwargs)

    @override
    def teardown(self) -> None:
        for handle in self._handles:  # after fit the model runs where the user puts it, without stage hooks
            handle.remove()
        self._handles = []
        super().teardown()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # torch's load_state_dict already puts each state on its parameter's device; Lightning's default would
        # then move everything to root_device, away from the parameters of the later stages.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)

    @classmethod
    def layout(
        cls, devices: int | None, num_nodes: int = 1, devices_per_process: int = DEVICES_PER_PROCESS, **init_args: Any
    ) -> Layout:
        """``trainer.devices`` counts processes; each needs ``devices_per_process`` GPUs of its own."""
        # model.compile auto stays off: its stage hooks move activations between GPUs inside the network (not
        # verified under torch.compile); --model.compile true still compiles
        return Layout(
            processes_per_node=devices, devices_per_process=int(devices_per_process), needs_process_gpus=True,
            parity="exact", runs_compiled_models=False,
        )  # fmt: skip

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "ddp_mp", cls, description="DDP across processes, model split over 2 devices per process", override=True
        )
