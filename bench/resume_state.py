"""Size and time of the training loader's position in a checkpoint, for an ImageNet epoch (1,281,167 samples) at 64
ranks, against what a saved index list would cost; and the resumed epoch's start (permutation + skip).

    python -m bench.resume_state      # -> bench/results/resume_state.md
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from datamodules.resumable import ResumableLoader, ResumableSampler

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLES, RANKS, BATCH, ROUNDS = 1_281_167, 64, 256, 200


class Indices(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


def serialized(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def main() -> None:
    samplers = [ResumableSampler(Indices(), RANKS, rank, seed=7) for rank in range(RANKS)]
    loaders = [ResumableLoader(Indices(), sampler, batch_size=BATCH) for sampler in samplers]
    batches = len(loaders[0]) // 2
    for loader in loaders:
        loader.load_state_dict({**loader.state_dict(), "epoch": 3, "batches": batches})
    loaders[2].load_state_dict({**loaders[2].state_dict(), "epoch": 2, "batches": 0})  # no skip: a new epoch
    start = time.perf_counter()
    for _ in range(ROUNDS):
        state = loaders[0].state_dict()
    save_us = (time.perf_counter() - start) / ROUNDS * 1e6
    state_bytes = serialized([state])  # what Lightning puts in the checkpoint: rank 0's, valid for every rank
    # the alternative: every rank's remaining index list (int64), gathered into the file
    sampler = loaders[0].sampler
    sampler.set_epoch(3)
    shard = torch.tensor(list(sampler), dtype=torch.int64)
    index_bytes = serialized([shard.clone() for _ in range(RANKS)])
    # a resumed epoch's start on one rank: the permutation and the skip of the batches already trained
    start = time.perf_counter()
    first = next(iter(loaders[1]))
    resume_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()  # the baseline: a new epoch's first batch, the same permutation work without a skip
    next(iter(loaders[2]))
    fresh_ms = (time.perf_counter() - start) * 1e3
    text = f"""# Loader position in checkpoints: ImageNet epoch at 64 ranks

`python -m bench.resume_state` (CPU, torch {torch.__version__}); {SAMPLES:,} samples, {RANKS} ranks, batch {BATCH} per
rank ({len(loaders[0])} batches per rank and epoch), saved half way ({batches} batches).

| what | value |
|---|---|
| loader state in the checkpoint (rank 0's, the same for every rank) | {state_bytes:,} bytes |
| the same as per-rank index lists (int64, 64 ranks) | {index_bytes:,} bytes |
| `state_dict()` time per save | {save_us:.1f} us |
| resumed epoch's first batch on a rank (permutation + skip of {batches * BATCH:,} samples) | {resume_ms:.1f} ms |
| baseline: any epoch's first batch (DistributedSampler's permutation of the whole epoch) | {fresh_ms:.1f} ms |

State: `{state}`; first resumed batch on rank 1 starts with sample {int(first[0])}.
"""
    (RESULTS / "resume_state.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
