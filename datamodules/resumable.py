"""Training loaders that resume mid-epoch exactly: the same samples in the same order, the same augmentations.

Why hand-written, and this small: Lightning saves and restores the state of a training loader that has
``state_dict``/``load_state_dict`` (``_FitLoop.on_save_checkpoint`` -> ``CombinedLoader._state_dicts``) but never makes
a loader stateful itself (Lightning#18780). torchdata's ``StatefulDataLoader`` (0.11) would, but it is a second copy
of torch's DataLoader, and on resume it re-seeds every worker with ``base_seed + worker_id``, the seed of the epoch's
*first* batch: a resumed worker draws other crops and flips than the uninterrupted one unless the dataset itself
keeps its random state. What exactness needs is two facts per rank: where the epoch's permutation is (its seed and
epoch, as in ``DistributedSampler``) and how many batches of it the training loop has taken. So:

- :class:`ResumableSampler` is a ``DistributedSampler`` (Lightning then injects no other) that can skip the samples of
  the current epoch already trained;
- :class:`ResumableLoader` counts the batches it hands to the training loop (not the ones its workers prefetched), and
  its ``state_dict`` is those few numbers (epoch, batches, layout): the same on every rank, so rank 0's file serves
  all ranks, and its size does not grow with the dataset (``bench/resume_state.py``);
- with random augmentations, every sample is loaded with the torch/numpy/python generators seeded from
  (seed, epoch, sample index) (:class:`SeededDataset`): what a worker draws for a sample does not depend on which
  worker loads it, how many workers there are, or where the run was resumed;
- repeated augmentation (``repeats`` > 1, the sampler of torchvision's and timm's recipes): each epoch draws
  ``1/repeats`` of the images and loads each ``repeats`` times, the copies spread over consecutive ranks; a copy is a
  position ``index x repeats + copy`` of a longer, virtual data set, so each copy has a seed, and augmentations, of
  its own, and the guarantees above hold for the virtual positions unchanged.

Resuming mid-epoch on another layout (processes, per-device batch, dataset size) cannot give the same batches: it is
refused with one line naming the fix. A checkpoint without loader state (saved by an earlier version) resumes as
before, restarting the epoch's permutation, with one warning line.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from core.env import global_seed
from core.errors import UserError


class ResumeLayoutError(UserError, RuntimeError):
    """A mid-epoch checkpoint resumed with another number of processes, per-device batch or dataset."""


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentations: a function of the run's seed, the epoch and the sample only."""
    return int(np.random.SeedSequence((seed & 0xFFFFFFFF, epoch, index)).generate_state(1)[0])


def _seed_all(value: int) -> None:
    # the CPU generator, which the transforms draw from: torch.manual_seed would also queue a lazy seeding of every
    # CUDA device, formatting a stack trace each time (~130 us per sample in a worker, 10 % of its decode + crop)
    torch.default_generator.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


class SeededDataset(Dataset):
    """``dataset[index // repeats]`` with the random generators seeded from (seed, epoch, index); keys are
    ``(index, epoch)``, ``index`` a position of the sampler (``repeats`` > 1: copy ``index % repeats`` of a sample).

    In a worker process the generators are simply re-seeded (nothing else draws from them there); in the main process
    (``num_workers`` 0) they are put back afterwards, so the training step's dropout draws what it would have.
    """

    def __init__(self, dataset: Dataset, seed: int, repeats: int = 1) -> None:
        self.dataset, self.seed, self.repeats = dataset, seed, repeats

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int] | int) -> Any:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        if get_worker_info() is not None:
            _seed_all(sample_seed(self.seed, epoch, index))
            return self.dataset[index // self.repeats]
        state = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            _seed_all(sample_seed(self.seed, epoch, index))
            return self.dataset[index // self.repeats]
        finally:
            torch.set_rng_state(state[0])
            random.setstate(state[1])
            np.random.set_state(state[2])


class _KeyedBatches:
    """The batch sampler's index lists as ``(index, epoch)`` keys for :class:`SeededDataset` (main process)."""

    def __init__(self, batch_sampler: Any, sampler: DistributedSampler) -> None:
        self.batch_sampler, self.sampler = batch_sampler, sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.batch_sampler:
            epoch = self.sampler.epoch
            yield [(index, epoch) for index in batch]


RA_EPOCH_MULTIPLE = 256  # torchvision's RASampler: an epoch is a multiple of this many samples over all ranks


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled, Lightning's seed) that skips ``skip`` samples of epoch ``skip_epoch`` once.

    With one process it is the whole permutation (``num_replicas=1``): the same code path on every layout.

    ``repeats`` > 1: repeated augmentation, as torchvision's ``RASampler`` (references/classification/sampler.py):
    the epoch's permutation with each sample repeated ``repeats`` times in a row (as positions ``index x repeats +
    copy``), padded to a multiple of the ranks, dealt to the ranks in turn, so the copies of a sample go to
    consecutive ranks; each rank keeps its first ``floor(len // 256 x 256 / ranks)`` positions: an epoch of
    ``floor(len / 256) x 256`` samples over all ranks, about a ``repeats``-th of them distinct. One process is one
    rank (as torchvision's sampler under torchrun with one process): the copies of a sample come one after the other.
    A data set of fewer than 256 samples (which torchvision's rounding would leave empty) keeps ``ceil(len / ranks)``
    positions per rank.
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int | None = None, repeats: int = 1
    ) -> None:
        seed = (global_seed() or 0) if seed is None else seed
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        if repeats < 1:
            raise ValueError(f"repeated augmentation needs 1 or more repeats, got {repeats}")
        self.repeats = repeats
        self.skip, self.skip_epoch = 0, -1
        size = len(dataset)  # type: ignore[arg-type]
        if repeats > 1 and size >= RA_EPOCH_MULTIPLE:
            self.num_samples = size // RA_EPOCH_MULTIPLE * RA_EPOCH_MULTIPLE // num_replicas

    def _positions(self) -> Iterator[int]:
        if self.repeats == 1:
            return super().__iter__()
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
        order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        positions = [index * self.repeats + copy for index in order for copy in range(self.repeats)]
        total = math.ceil(len(positions) / self.num_replicas) * self.num_replicas
        total = max(total, self.total_size)  # a tiny data set on many ranks: every rank gets its ceil(len / ranks)
        positions = (positions * math.ceil(total / len(positions)))[:total]  # torchvision's padding from the start
        return iter(positions[self.rank :: self.num_replicas][: self.num_samples])

    def __iter__(self) -> Iterator[int]:
        indices = self._positions()
        if self.skip_epoch == self.epoch and self.skip:
            skip, self.skip, self.skip_epoch = self.skip, 0, -1
            for _ in range(skip):
                next(indices)
        return indices


def ignore_sigint(worker_id: int) -> None:
    # Ctrl-C goes to the terminal's whole process group, workers included: a worker that died of it would end the
    # epoch with "DataLoader worker exited unexpectedly" before the training loop reaches its step boundary. The
    # workers still end with their training process (torch's worker loop watches its parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ResumableLoader(DataLoader):
    """A training ``DataLoader`` whose ``state_dict`` says how far into which epoch the training loop got.

    Args:
        dataset: the training set (a :class:`SeededDataset` when its transforms draw random numbers).
        sampler: its :class:`ResumableSampler`.
        progress: batches of the current epoch Lightning's loop has already completed (to tell a mid-epoch resume
            from a checkpoint that has no loader state); called when an iteration starts, it also hands this loader
            the checkpoint's state if Lightning has not yet (see ``ImageDataModule._batches_done``). None outside a
            Trainer.
        **kwargs: the other ``DataLoader`` arguments.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: ResumableSampler,
        progress: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        # a generator of its own: creating an iterator draws the workers' base seed from it, not from the global
        # generator, whose next values are the training step's dropout masks
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("worker_init_fn", ignore_sigint)
        super().__init__(dataset, sampler=sampler, **kwargs)
        self.progress = progress
        self._position = (sampler.epoch, 0)  # (epoch, batches handed to the training loop)
        self._pending: dict[str, int] | None = None
        self.asked_at: float | None = None  # time.perf_counter() of the training loop's latest request for a batch

    @property
    def _index_sampler(self) -> Any:
        index_sampler = super()._index_sampler
        if isinstance(self.dataset, SeededDataset) and self.batch_sampler is not None:
            return _KeyedBatches(index_sampler, self.sampler)  # type: ignore[arg-type]
        return index_sampler

    def _layout(self) -> dict[str, int]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        return {
            "num_replicas": sampler.num_replicas,
            "batch_size": int(self.batch_size or 1),
            "dataset_size": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": sampler.seed,
            "repeats": getattr(sampler, "repeats", 1),
        }

    def state_dict(self) -> dict[str, int]:
        """Where the training loop is: the epoch and the batches of it already handed out, and the layout."""
        epoch, batches = self._position
        if self._pending is not None:  # restored, not iterated yet
            epoch, batches = self._pending["epoch"], self._pending["batches"]
        return {"epoch": epoch, "batches": batches, **self._layout()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Remembers where to start; applied when the next iteration starts if it is that epoch's."""
        self._pending = dict(state_dict)
        self.sampler.set_epoch(state_dict["epoch"])  # type: ignore[attr-defined]

    def _start(self) -> int:
        """At an iteration's first batch: the batches of this epoch to skip (0 for a new epoch)."""
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        done = self.progress() if self.progress is not None else 0  # may load the checkpoint's state into this loader
        pending, self._pending = self._pending, None
        if pending is None or pending["epoch"] != sampler.epoch or not pending["batches"]:
            if done and pending is None:
                rank_zero_warn(
                    f"The checkpoint was saved at batch {done} of epoch {sampler.epoch} without the loader's position "
                    "(saved by an earlier version): the rest of this epoch restarts its sample order, so some "
                    "samples are trained twice and others not at all; the epochs after it are exact."
                )
            return 0
        saved = {k: pending.get(k, 1 if k == "repeats" else None) for k in self._layout()}  # (older: no repeats)
        if saved != self._layout():
            changed = ", ".join(f"{k} {saved[k]} -> {v}" for k, v in self._layout().items() if saved[k] != v)
            raise ResumeLayoutError(
                f"the checkpoint was saved mid-epoch (epoch {pending['epoch']}, batch {pending['batches']}) with "
                f"another data layout ({changed}): resuming it exactly needs the same layout. Resume with the "
                "checkpoint's trainer.devices/num_nodes and data.batch_size, or from a checkpoint saved at an "
                "epoch's end."
            )
        if done and done != pending["batches"]:
            raise RuntimeError(f"loader state says batch {pending['batches']}, the training loop batch {done}")
        sampler.skip, sampler.skip_epoch = pending["batches"] * saved["batch_size"], sampler.epoch
        return pending["batches"]

    def __iter__(self) -> Iterator[Any]:
        # A generator: the body (and the workers' start) runs at the first batch, i.e. after Lightning has set this
        # epoch on the sampler. Lightning creates the resumed epoch's iterator in setup_data(), before set_epoch.
        batches = self._start()
        epoch = self.sampler.epoch  # type: ignore[attr-defined]
        self._position = (epoch, batches)
        iterator = super().__iter__()
        while True:
            # when the training loop asked for this batch: the rank's wait for its data starts here (app.callbacks.
            # throughput.gap_parts), the rest of the gap between two steps is Lightning's loop
            self.asked_at = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            batches += 1
            self._position = (epoch, batches)
            yield batch
