"""How loader workers start (``datamodules.base.worker_context``): from a forkserver in a multi-process job on CPython
before 3.12, where a worker forked from a rank can hang inside ``os.fork`` (gh-112275); by fork otherwise.

What a user would notice if the forkserver path broke: every shipped dataset must load in such a worker exactly as
in the main process (its classes unpickled there, the per-sample seeding of random crops unchanged), and no worker
may be a fork of the job's own, many-threaded, process. The forkserver is Python 3.14's default start method, so these
checks run on every Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules import ImageNetDataModule, MNISTDataModule
from datamodules.base import worker_context
from datamodules.resumable import SeededDataset
from datamodules.shards import Options, convert
from tools.photos import build_photo_imagenet

pytestmark = pytest.mark.slow  # a forkserver starts (and imports torch) once per process: seconds


class ParentPid(Dataset):
    """Each item: the process id of the worker's parent."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return os.getppid()


def test_a_multi_process_job_starts_its_workers_from_a_forkserver_before_python_3_12():
    assert worker_context(1) is None  # one process: PyTorch's default (fork)
    context = worker_context(2)
    if sys.version_info >= (3, 12):
        assert context is None
    else:
        assert context.get_start_method() == "forkserver"
        parents = list(DataLoader(ParentPid(), batch_size=None, num_workers=2, multiprocessing_context=context))
        assert os.getpid() not in parents, parents  # forked from the server, not from this (threaded) process


@pytest.fixture(scope="module")
def image_sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker_start")
    photos = build_photo_imagenet(root / "photos")
    shards = root / "shards"
    convert(photos, shards, Options(shard_images=4), progress=False)
    return {"folder": photos, "shards": shards}


@pytest.mark.parametrize("layout", ["folder", "shards"])
def test_imagenet_samples_are_the_same_from_forkserver_workers(image_sets, layout):
    """The training set with its random crop and flip, seeded per (seed, epoch, sample) as a run loads it."""
    dm = ImageNetDataModule(data_dir=str(image_sets[layout]), batch_size=3, num_workers=2, image_size=32)
    dm.setup("fit")
    seeded = SeededDataset(dm.train_set, 7)
    keys = [(index, epoch) for epoch in (0, 1) for index in range(len(seeded))]
    here = [seeded[key] for key in keys]
    loader = DataLoader(seeded, sampler=keys, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    there = list(loader)
    assert len(there) == len(here) == 36
    for (image, label), (expected, expected_label) in zip(there, here, strict=True):
        assert torch.equal(image, expected) and int(label) == int(expected_label)
    assert not torch.equal(there[0][0], there[18][0])  # epoch 1 draws other crops: the seeding did take effect


def test_mnist_samples_are_the_same_from_forkserver_workers(mnist_dir):
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=8, num_workers=2)
    dm.setup("fit")
    indices = list(range(0, len(dm.train_set), 5000))
    loader = DataLoader(
        dm.train_set, sampler=indices, batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    for index, (image, label) in zip(indices, loader, strict=True):
        expected, expected_label = dm.train_set[index]
        assert torch.equal(image, expected) and int(label) == int(expected_label)
