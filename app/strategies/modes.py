"""The registered modes the tools, benchmarks and checks run, found by their declared
:class:`~core.layout.Layout`, never by name: the reference mode, those with a parity claim, every declared one.
Importing this module registers the app's modes (``app.strategies``) first."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from core.layout import Parity, layout_of

REFERENCE = "ddp"  # Lightning's DDP: the mode every other is compared with (``tools.parity``'s "vs ddp" column)


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
