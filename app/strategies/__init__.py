"""Parallel modes as Lightning strategies, registered by name in Lightning's StrategyRegistry on import.

``dp`` (DataParallel), ``allreduce`` (+ ``allreduce_per_param``, ``allreduce_overlap``, ``allreduce_fp16``,
``allreduce_bf16``) and ``ddp_mp``. ``ddp`` and its variants are Lightning's own. Each class declares its
:class:`~core.layout.Layout` (processes, devices, parity claims) in a ``layout`` classmethod; whatever needs to
know how a mode runs reads it through :func:`~core.layout.layout_of`. A new mode: one file here,
imported below.
"""

from lightning.pytorch.strategies import StrategyRegistry

from app.strategies.allreduce import AllReduceStrategy
from app.strategies.ddp_mp import DDPModelParallelStrategy
from app.strategies.dp import DataParallelStrategy

for _strategy in (DataParallelStrategy, AllReduceStrategy, DDPModelParallelStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = ["AllReduceStrategy", "DDPModelParallelStrategy", "DataParallelStrategy"]
