"""A throwaway sixth parallel mode, registered on import: DDP under a new name whose layout gives every process
``devices_per_process`` GPUs of its own and claims exact parity with one device. Nothing else in the repository names
it: the parity tool, the preflight plan and the parity job find it through the registry and the layout alone.

``tests/unit/test_sixth_strategy.py`` registers it for its own tests (and removes it after); the parity job's
processes import this module because the scenario lists it under ``imports``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from core.layout import Layout

NAME = "sixth"


class SixthStrategy(DDPStrategy):
    """Lightning's DDP; only its declared layout is new."""

    strategy_name = NAME

    @classmethod
    def layout(cls, devices: int | None, num_nodes: int = 1, devices_per_process: int = 3, **init_args: Any) -> Layout:
        return Layout(
            processes_per_node=devices, devices_per_process=devices_per_process, needs_process_gpus=True,
            parity="exact", fp16_parity=True,
        )  # fmt: skip


def register() -> None:
    StrategyRegistry.register(NAME, SixthStrategy, description="a test's throwaway sixth mode", override=True)


register()
