"""Random generator states in checkpoints, so a resumed run draws what an uninterrupted one would.

Lightning's checkpoints hold model, optimizer, schedulers, GradScaler, loops and callbacks but not the random
generators, so shuffling and dropout after a resume would differ from an uninterrupted run. :class:`RNGState`
stores every rank's generator states and restores them on resume. Lightning's ``_collect_rng_states`` and
``_set_rng_states`` do the torch and Python generators; numpy's state is stored as tensors (a checkpoint stays
loadable with ``weights_only=True``) and CUDA's per visible device (a run may resume with fewer GPUs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from app.lightning_private import collect_rng_states, set_rng_states


def _local_rng_state() -> dict[str, Any]:
    state = collect_rng_states(include_cuda=False)
    kind, keys, pos, has_gauss, cached = state["numpy"]
    return {
        "torch": state["torch"],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        # numpy's state as tensors and numbers, so the checkpoint stays loadable with weights_only=True
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
            "kind": kind,
        },  # fmt: skip
        "python": state["python"],
    }


def _set_local_rng_state(state: dict[str, Any]) -> None:
    n = state["numpy"]
    numpy = (n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    set_rng_states({"torch": state["torch"].cpu(), "numpy": numpy, "python": state["python"]})
    if state["cuda"] and torch.cuda.is_available():
        # the run may resume with fewer visible GPUs than it saved states for (set_rng_state_all would raise
        # IndexError): restore the devices that exist; a process only ever draws on its own device's generator
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(saved.cpu(), index)


class RNGState(Callback):
    """Saves every rank's torch/CUDA/numpy/python random states in checkpoints and restores them on resume.

    Restoring happens when Lightning loads the callback states, before the training data loader draws its
    shuffling seed, so a resumed run sees the same batches and dropout masks as an uninterrupted one.
    """

    def state_dict(self) -> dict[str, Any]:
        mine = _local_rng_state()
        # dump_checkpoint runs on every rank (only rank 0 writes), so all ranks can take part in the gather
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("ranks") or []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= len(states):
            rank_zero_warn(
                f"The checkpoint holds random states for {len(states)} rank(s) but this run has more; ranks beyond "
                "them keep their seeded state, so the resumed run is not bit-identical to an uninterrupted one."
            )
            return
        _set_local_rng_state(states[rank])
