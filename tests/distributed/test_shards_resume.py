"""Shards resumed mid-epoch: a real ``cli.py fit`` on shards converted from the real test photos, stopped by a real
SIGTERM in epoch 0 and resumed with ``--ckpt_path last``, runs on through epoch 1 and ends bit-identical to the
uninterrupted run; each epoch trains every image exactly once, and the epoch after the resume is a whole new
permutation, not a replay of the resumed epoch's tail (litdata's stale restore flag does replay it:
``../shared/notes/sharded-data.md``, trap 2; ``tests/sabotage/resume_offset_kept_into_next_epoch.patch``).

Which image a recorded sample is: ``tools.resume_probe.SampleLog`` records a digest of each sample's pixels after its
crop and flip, and those are a function of (seed, epoch, image) only (``datamodules.resumable.SeededDataset``). So
the training set itself, read here in this process with the run's seed, gives every (epoch, image) its digest, and
each recorded digest names its image without relying on the sampler under test.

One device with 2 loader workers; and 2 gloo processes with 1 worker each in one torchrun job (run as a module,
``torchrun ... -m tests.distributed.test_shards_resume OUT SHARDS``, it is that job). Two epochs (a third cost half
as much again): a stale restore shows in the first epoch after the resume.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from datamodules import ImageNetDataModule
from datamodules.resumable import SeededDataset
from datamodules.shards import Options, convert
from tools.photos import build_photo_imagenet
from tools.resume_legs import imagenet_args, legs
from tools.resume_probe import read_samples

SEED, EPOCHS, STOP, BATCH = 7, 2, 2, 3  # 18 images, 3 per device: 6 batches per epoch on 1 device, 3 on 2
IMAGES = 18

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards_resume")
    out = root / "shards"
    convert(build_photo_imagenet(root / "photos"), out, Options(shard_images=4), progress=False)  # 5 training shards
    return out


def digest(image, label: int) -> str:  # as SampleLog's
    return hashlib.sha1(image.numpy().tobytes() + bytes(str(int(label)), "ascii")).hexdigest()[:12]


def images_by_digest(shards: Path) -> list[dict[str, int]]:
    """Per epoch, each training image's digest -> its index, as the run's loader workers produce them."""
    dm = ImageNetDataModule(data_dir=str(shards), batch_size=BATCH, num_workers=0, image_size=32)
    dm.setup("fit")
    seeded = SeededDataset(dm.train_set, SEED)
    tables = []
    for epoch in range(EPOCHS):
        table = {digest(*seeded[index, epoch]): index for index in range(len(seeded))}
        assert len(table) == len(seeded) == IMAGES, "two images with the same pixels: digests cannot tell them apart"
        tables.append(table)
    return tables


def per_epoch(folder: Path, rank: int, tables: list[dict[str, int]]) -> list[list[int]]:
    """The image indices ``rank`` trained on in each epoch, in order (stopped and resumed runs: both records)."""
    epochs: list[list[int]] = [[] for _ in tables]
    for batch in read_samples(folder, rank):
        epochs[batch["epoch"]] += [tables[batch["epoch"]].get(d, -1) for d in batch["samples"]]
    return epochs


def check(facts: dict, workdir: Path, shards: Path, ranks: int) -> None:
    batches = IMAGES // (BATCH * ranks)
    assert facts["exit"] == 143 and facts["saved_step"] == STOP and facts["saved_epoch"] == 0, facts
    assert facts["loader_state"][0]["epoch"] == 0 and facts["loader_state"][0]["batches"] == STOP, facts
    assert facts["steps"] == [EPOCHS * batches] * 2, facts  # the resumed run: no epoch cut short
    tables = images_by_digest(shards)
    full = [per_epoch(workdir / "full", rank, tables) for rank in range(ranks)]
    resumed = [per_epoch(workdir / "stopped", rank, tables) for rank in range(ranks)]
    for epoch in range(EPOCHS):
        seen = [index for rank in range(ranks) for index in full[rank][epoch]]
        assert sorted(seen) == list(range(IMAGES)), (epoch, seen)  # each image once, with this epoch's augmentation
        for rank in range(ranks):
            assert resumed[rank][epoch] == full[rank][epoch], (rank, epoch, full[rank], resumed[rank])
    assert full[0][0] != full[0][1]  # every epoch its own permutation
    for rank, seen in facts["samples"].items():
        assert seen["same"] and seen["trained"] == seen["recorded"] == EPOCHS * batches, (rank, facts)
    assert facts["max_diff"] == 0.0, f"the resumed run differs from the uninterrupted one: {facts}"


def shard_legs(workdir: Path, shards: Path, workers: int, extra: list[str], ranks: int) -> dict:
    data = imagenet_args(workdir, str(shards), workers)
    batches = IMAGES // (BATCH * ranks)  # limit_train_batches: the whole epoch
    return legs(workdir, data, ["--trainer.max_epochs", str(EPOCHS), *extra], ranks, stop=STOP, batches=batches)


def test_shards_resumed_in_epoch_0_run_exact_and_a_whole_epoch_after_it(shards, tmp_path):
    check(shard_legs(tmp_path, shards, 2, [], ranks=1), tmp_path, shards, ranks=1)


@pytest.mark.distributed
def test_two_processes_on_shards_resumed_in_epoch_0_run_exact_and_a_whole_epoch_after_it(shards, tmp_path):
    from tools.torchrun import run_torchrun_job

    facts = run_torchrun_job(
        "tests.distributed.test_shards_resume", [str(tmp_path), str(shards)], 2, tmp_path / "results.json",
        "shards resume", timeout=900,
    )  # fmt: skip
    facts["samples"] = {int(rank): seen for rank, seen in facts["samples"].items()}
    check(facts, tmp_path, shards, ranks=2)


def job(out: Path, shards: Path) -> None:
    """One rank of the torchrun job: the three legs on 2 processes; rank 0 writes the facts."""
    import torch.distributed as dist

    extra = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--launch.timeout", "120"]
    facts = shard_legs(out, shards, 1, extra, ranks=2)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(facts, indent=1))
    dist.barrier()


if __name__ == "__main__":
    import gc

    gc.freeze()  # as cli.py does: the imports' objects out of the cyclic collector's reach
    job(Path(sys.argv[1]), Path(sys.argv[2]))
