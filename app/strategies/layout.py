"""How a parallel mode lays its processes over devices, as the strategy class declares it.

A strategy class may define ``layout(cls, devices, num_nodes, **init_args) -> Layout``; its registry entry's
``init_params`` (``allreduce_fp16``: ``compression="fp16"``) and the config's ``init_args`` are passed in. A class
without one (Lightning's ``ddp`` and its variants) runs one process per device. The plan, the throughput callback, the
parity tool, the tests and the benchmarks read the layout through :func:`layout_of`, never the mode's name. The
registry entry is read, not instantiated: some strategies need packages that may be missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from lightning.pytorch.strategies import StrategyRegistry

from core.config import get

Parity = Literal["exact", "close"] | None
REFERENCE = "ddp"  # Lightning's DDP: the mode every other is compared with (``tools.parity``'s "vs ddp" column)


@dataclass(frozen=True)
class Layout:
    """Processes and devices of one mode.

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
    """

    processes_per_node: int | None
    devices_per_process: int = 1
    one_process: bool = False
    splits_batch: bool = False
    needs_process_gpus: bool = False
    parity: Parity = None
    fp16_parity: bool = False
    averages_by_hand: bool = False


def one_process_per_device(devices: int | None, num_nodes: int = 1, **init_args: Any) -> Layout:
    """The default layout: one process per device, no parity claim."""
    return Layout(processes_per_node=devices)


def strategy_name(strategy: Any) -> str:
    """The registered name of ``trainer.strategy`` (``dp``, ``ddp``, ...), or its class path."""
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


def _entry(strategy: Any) -> tuple[type | None, dict[str, Any]]:
    """The class and init arguments a strategy name, class or config (``class_path`` + ``init_args``) stands for."""
    if isinstance(strategy, type):
        return strategy, {}
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
    """The layout of a strategy given by registered name, class or config, on ``devices`` per node."""
    cls, init_args = _entry(strategy)
    declare = getattr(cls, "layout", None)
    if declare is None:
        return one_process_per_device(devices, num_nodes)
    return declare(devices, num_nodes, **init_args)


def parity_modes(parity: Parity = "exact", fp16: bool | None = None) -> list[str]:
    """The registered modes that declare ``parity`` (and ``fp16_parity`` when given), the reference ``ddp`` first."""
    modes = [REFERENCE] if parity == "exact" else []
    for name in StrategyRegistry:
        layout = layout_of(name)
        if layout.parity == parity and name not in modes:
            modes.append(name)
    if fp16 is not None:
        modes = [m for m in modes if m == REFERENCE or layout_of(m).fp16_parity == fp16]
    return modes


def declared_modes(variants: bool = True) -> list[str]:
    """The modes the tools and benchmarks run, so that a new one needs no edit there: the reference ``ddp`` first, then
    every registered name whose strategy class declares its layout (the app's modes, and any registered like them).
    ``variants=False``: one name per class, its entry without preset arguments (``allreduce``, not
    ``allreduce_fp16``)."""
    modes = [REFERENCE]
    for name, entry in StrategyRegistry.items():
        declared = getattr(entry["strategy"], "layout", None) is not None
        if declared and name not in modes and (variants or not entry["init_params"]):
            modes.append(name)
    return modes
