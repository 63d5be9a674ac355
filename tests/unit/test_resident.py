"""MNIST held resident (a batch is one indexing of a tensor on the training device) against the DataLoader's
per-sample path: the same batches in the same order, the choice of ``auto``, and the refusal of workers."""

from __future__ import annotations

import pytest
import torch

from app.command import main
from datamodules import MNISTDataModule
from datamodules.resident import FREE_MEMORY_SHARE, ResidentTensors, decide, free_memory
from tests.conftest import short_fit


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, y) for x, y in loader]


def test_resident_batches_are_the_loader_paths_batches(mnist_dir):
    """Every batch of an epoch of each split, as the training loop receives it: equal tensors, in the same order."""
    paths = {}
    for resident in (True, False):
        dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=256, resident=resident)
        dm.setup("fit")
        dm.setup("test")
        assert dm.resident is resident
        paths[resident] = dm
    assert isinstance(paths[True].train_set, ResidentTensors) and paths[True].train_set.tensors[0].is_contiguous()
    assert paths[True].val_set.indices == paths[False].val_set.indices  # the same seeded split
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        resident, per_sample = (_batches(getattr(paths[r], loader)()) for r in (True, False))
        assert len(resident) == len(per_sample) > 1, loader
        for (x, y), (x2, y2) in zip(resident, per_sample, strict=True):
            assert torch.equal(x, x2) and torch.equal(y, y2), loader
        assert resident[0][0].shape == (256, 1, 28, 28) and resident[0][1].dtype == torch.int64


def test_auto_is_resident_when_the_splits_fit_in_a_quarter_of_free_memory():
    cpu = torch.device("cpu")
    free = free_memory(cpu)
    assert free > 0
    fits, line = decide("auto", 0, int(free * FREE_MEMORY_SHARE * 0.5), cpu)
    assert fits and "so they stay there" in line
    too_big, line = decide("auto", 0, int(free * FREE_MEMORY_SHARE * 2), cpu)
    assert not too_big and "the loader path is used" in line
    with_workers, line = decide("auto", 2, 1000, cpu)
    assert not with_workers and "data.num_workers 2 asked for" in line
    assert decide(False, 0, 1000, cpu)[0] is False


def test_resident_true_with_workers_is_refused_before_training(mnist_dir, tmp_path, capsys):
    args = ["fit", *short_fit(tmp_path, mnist_dir, 2, 1), "--data.resident", "true", "--data.num_workers", "2"]
    with pytest.raises(SystemExit) as refused:  # the preflight's error, printed by the command: status 1
        main(args)
    assert refused.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "data.resident true" in x]
    assert "data.num_workers 2 would have nothing to load" in line and "--data.resident false" in line
    assert not list(tmp_path.rglob("*.ckpt"))
