"""How a parallel mode lays its processes over devices, as the strategy class declares it, and the one lookup of it.

A strategy class may define ``layout(cls, devices, num_nodes, **init_args) -> Layout``; its registry entry's
``init_params`` (``allreduce_fp16``: ``compression="fp16"``) and the config's ``init_args`` are passed in. A class
without one (Lightning's ``ddp`` and its variants) runs one process per device. Whatever needs to know how a mode runs
(the plan, the preflight's checks, the model's compile choice, the batch mixing, the throughput callback, the parity
tool, the tests and the benchmarks) asks :func:`layout_of`, for a configured name, class or config or for the live
``trainer.strategy``, never the mode's name. A registry entry is read, not instantiated: some strategies need packages
that may be missing. Names are those registered when asked: ``import app.strategies`` registers the app's modes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, replace
from typing import Any, Literal

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from core.config import get

Parity = Literal["exact", "close"] | None


@dataclass(frozen=True)
class Layout:
    """Processes and devices of one mode, and what it says of its arguments.

    Attributes:
        processes_per_node: processes each node runs (None while the device count is unknown).
        devices_per_process: devices one process drives (``dp``: all of the node's; ``ddp_mp``: its stages).
        one_process: the mode runs a single process whatever the launcher (``dp``).
        splits_batch: one DataLoader batch is split across the devices of a process (``dp``).
        needs_process_gpus: ``trainer.devices`` counts processes and each process needs ``devices_per_process`` GPUs
            of its own (``ddp_mp``).
        parity: ``exact``: trains the same weights as one device in fp32 (to rounding); ``close``: within the wire
            precision; None: not compared by ``tools.parity`` by default.
        fp16_parity: takes part in the fp16 GradScaler parity scenario (an overflow on one rank skips every rank).
        averages_by_hand: the strategy averages the gradients with its own ``all_reduce`` (no DDP wrapper); the
            step-time benchmark compares it with the plain hand-averaging loop of the PyTorch tutorial.
        runs_compiled_models: ``model.compile auto`` compiles under this mode (``dp``, ``ddp_mp``: no).
        problems: the mistakes in the mode's arguments, each with its fix (the class's ``config_problems``, asked by
            the preflight before the strategy is built; none for a live strategy, built from a checked config).
    """

    processes_per_node: int | None
    devices_per_process: int = 1
    one_process: bool = False
    splits_batch: bool = False
    needs_process_gpus: bool = False
    parity: Parity = None
    fp16_parity: bool = False
    averages_by_hand: bool = False
    runs_compiled_models: bool = True
    problems: tuple[str, ...] = ()

    def batch_splits(self, device_type: str) -> int:
        """The shards each batch of a process is split into on ``device_type``: one per device where the mode splits
        it (``dp``'s replicas, one per GPU), else 1; on the CPU every device of a process is the CPU (no replicas)."""
        return self.devices_per_process if self.splits_batch and device_type == "cuda" else 1


def one_process_per_device(devices: int | None, num_nodes: int = 1, **init_args: Any) -> Layout:
    """The default layout: one process per device, no parity claim."""
    return Layout(processes_per_node=devices)


def strategy_name(strategy: Any) -> str:
    """The registered name of a configured strategy (``dp``, ``ddp``, ...), or its class path."""
    if isinstance(strategy, str):
        return strategy
    class_path = get(strategy, "class_path") or type(strategy).__name__
    module, _, qualname = str(class_path).rpartition(".")
    for name, entry in StrategyRegistry.items():
        cls = entry["strategy"]
        # the config may name the class where its package exports it: app.strategies.DDPModelParallelStrategy
        if cls.__qualname__ == qualname and cls.__module__.startswith(module) and not entry["init_params"]:
            return name
    return class_path


@functools.cache
def _declared_arguments(cls: type) -> tuple[str, ...]:
    """The named arguments of ``cls.layout`` but the devices and nodes (``compression``, ``devices_per_process``)."""
    parameters = inspect.signature(cls.layout).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in parameters if p.kind in named and p.name not in ("devices", "num_nodes"))


def _entry(strategy: Any) -> tuple[type | None, dict[str, Any]]:
    """The class and init arguments a strategy name, class, config (``class_path`` + ``init_args``) or live strategy
    stands for; a live one's arguments are its attributes named as its ``layout`` names them."""
    if isinstance(strategy, type):
        return strategy, {}
    if isinstance(strategy, Strategy):
        cls = type(strategy)
        names = _declared_arguments(cls) if hasattr(cls, "layout") else ()
        return cls, {name: getattr(strategy, name) for name in names if hasattr(strategy, name)}
    name = strategy_name(strategy)
    given = dict(get(strategy, "init_args", default={}) or {}) if not isinstance(strategy, str) else {}
    if name in StrategyRegistry:
        entry = StrategyRegistry[name]
        return entry["strategy"], {**entry["init_params"], **given}
    module, _, qualname = name.rpartition(".")
    try:  # a class_path the registry does not know
        return getattr(importlib.import_module(module), qualname), given
    except (ImportError, AttributeError, ValueError):
        return None, given


def layout_of(strategy: Any, devices: int | None = 1, num_nodes: int = 1) -> Layout:
    """The layout of a strategy given by registered name, class, config or as the live ``trainer.strategy``, on
    ``devices`` per node (a live strategy: the devices and nodes it was given)."""
    cls, init_args = _entry(strategy)
    if isinstance(strategy, Strategy):
        devices = len(getattr(strategy, "parallel_devices", None) or [None])
        num_nodes = int(getattr(strategy, "num_nodes", 1) or 1)
    declare = getattr(cls, "layout", None)
    layout = declare(devices, num_nodes, **init_args) if declare else one_process_per_device(devices, num_nodes)
    check = getattr(cls, "config_problems", None)
    if isinstance(strategy, Strategy) or not callable(check):  # a built strategy's arguments were checked before
        return layout  # it was built (the preflight asks its config); a live lookup is on the step's path (mixing)
    return replace(layout, problems=tuple(check(init_args)))
