"""The modern ImageNet recipe's pieces (configs/imagenet_modern.yaml): the repeated-augmentation sampler's shares and
resume, TrivialAugment's and random erasing's draws as GPU decoding replays them, the mixing of a batch per device's
share, no weight decay on normalisation layers and biases, and the weights' moving average in checkpoints and in
validation. Their exact resume and parity across modes: tests/distributed/test_resume_anywhere.py, test_parity.py."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler
from torchvision.transforms import v2

from app.callbacks import EMA
from core.batch import torchvision_adjusted
from datamodules import MNISTDataModule
from datamodules.augment import (
    MEAN_LEVELS,
    BatchMixer,
    apply_trivial_augment,
    erase_batch,
    erasing_draw,
    trivial_augment,
    trivial_augment_draw,
)
from datamodules.imagenet import ImageNetDataError, ImageNetDataModule
from datamodules.resumable import ResumableLoader, ResumableSampler, ResumeLayoutError, SeededDataset
from modules import ImageClassifier
from tests.conftest import fast_trainer
from tests.unit.test_imagenet import photos  # noqa: F401  (the real-photo ImageFolder fixture)


# ------------------------------------------------------------------------------------------------ repeated augmentation
@pytest.mark.parametrize("world", [1, 2, 3])
def test_repeated_augmentation_gives_each_rank_its_share_of_copies(world):
    """18 samples, 4 copies each: every rank gets ceil(18 / world) positions, the ranks' positions are disjoint, each
    sample's copies are consecutive positions dealt to consecutive ranks, and an epoch holds about 18 / 4 samples."""
    shards = [list(ResumableSampler(range(18), num_replicas=world, rank=r, seed=7, repeats=4)) for r in range(world)]
    assert all(len(s) == math.ceil(18 / world) for s in shards)
    flat = [p for s in shards for p in s]
    assert len(flat) == len(set(flat))  # no position twice: each copy once
    samples = {p // 4 for p in flat}
    assert len(samples) <= math.ceil(18 / 4) + 1 and all(sum(p // 4 == i for p in flat) <= 4 for i in samples)
    if world > 1:  # the first sample of the epoch: its copies 0, 1, .. on ranks 0, 1, ..
        first = shards[0][0] // 4
        assert [s[0] for s in shards] == [first * 4 + r for r in range(world)]
    again = ResumableSampler(range(18), num_replicas=world, rank=0, seed=7, repeats=4)
    again.set_epoch(1)
    assert list(again) != shards[0]  # another epoch, another permutation
    plain = ResumableSampler(range(18), num_replicas=world, rank=0, seed=7)
    assert list(plain) == list(DistributedSampler(range(18), num_replicas=world, rank=0, seed=7))


def test_repeated_augmentation_resumes_mid_epoch_and_refuses_other_repeats():
    """A loader restored at batch 2 of epoch 1 yields the rest of that epoch's positions; a checkpoint of another
    repeat count is refused in one line; the copies of a sample get augmentations of their own."""
    dataset = SeededDataset(list(range(18)), seed=7, repeats=4)
    whole = list(ResumableLoader(dataset, ResumableSampler(range(18), seed=7, repeats=4), batch_size=3))
    sampler = ResumableSampler(range(18), seed=7, repeats=4)
    sampler.set_epoch(1)
    full = [p for b in ResumableLoader(dataset, sampler, batch_size=3) for p in b]
    resumed = ResumableLoader(dataset, ResumableSampler(range(18), seed=7, repeats=4), batch_size=3)
    resumed.load_state_dict({"epoch": 1, "batches": 2, **resumed._layout()})
    assert [p for b in resumed for p in b] == full[6:]
    assert [p for b in whole for p in b] != full  # not vacuous: epoch 0 is another order
    other = ResumableLoader(dataset, ResumableSampler(range(18), seed=7, repeats=3), batch_size=3)
    other.load_state_dict({"epoch": 1, "batches": 2, **resumed._layout()})
    with pytest.raises(ResumeLayoutError, match="repeats 4 -> 3"):
        next(iter(other))
    noisy = SeededDataset(_Noise(), seed=7, repeats=4)
    assert noisy[(8, 0)] != noisy[(9, 0)] and noisy[(8, 0)] == noisy[(8, 0)]  # copies 0 and 1 of sample 2


class _Noise(torch.utils.data.Dataset):
    """A sample is a random number: what its seed draws."""

    def __len__(self) -> int:
        return 18

    def __getitem__(self, index: int) -> float:
        return float(torch.rand(()))


def test_validation_sees_every_image_once_under_repeated_augmentation(photos, monkeypatch):  # noqa: F811
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
        dm = ImageNetDataModule(str(photos), batch_size=3, num_workers=0, image_size=32, repeated_augmentation=4)
        dm.trainer = trainer
        dm.setup("fit")
        assert len(dm.train_dataloader()) == 3  # 9 of the 18 positions per rank, 3 per batch
        seen += [int(y) for _, labels in dm.val_dataloader() for y in labels]
    assert sorted(seen) == sorted(label for _, label in dm.val_set.samples)  # the 9 photos, once each


def test_out_of_range_options_are_one_line_each(photos):  # noqa: F811
    with pytest.raises(ImageNetDataError, match=r"data.random_erasing=1.5 is out of range: a probability"):
        ImageNetDataModule(str(photos), random_erasing=1.5)
    problems = ImageNetDataModule.config_problems(
        {"data_dir": str(photos), "mixup_alpha": -1, "repeated_augmentation": 0}
    )
    assert [p.split(" is")[0] for p in problems] == ["data.mixup_alpha=-1", "data.repeated_augmentation=0"]


# ------------------------------------------------------------------------------------------------ per-image draws
def test_gpu_decodings_draws_replay_trivial_augment_and_erasing_as_torchvision_draws_them(photos):  # noqa: F811
    """Under the same seed, the operation and magnitude drawn in a worker and applied later give what
    TrivialAugmentWide itself gives, for every operation; random erasing's drawn box is the one it erases."""
    image = v2.functional.pil_to_tensor(v2.functional.resize(_photo(photos), [48, 48]))
    augment, erasing, ops = trivial_augment(), v2.RandomErasing(0.5, value=list(MEAN_LEVELS)), set()
    for seed in range(60):
        torch.manual_seed(seed)
        expected = augment(image)
        torch.manual_seed(seed)
        op, magnitude = trivial_augment_draw(augment)
        assert torch.equal(apply_trivial_augment(augment, image, op, magnitude), expected), (seed, op, magnitude)
        ops.add(op)
        torch.manual_seed(seed)
        erased = erasing(image)
        torch.manual_seed(seed)
        box = torch.tensor([erasing_draw(erasing, (48, 48))])
        value = torch.tensor(MEAN_LEVELS, dtype=torch.float32)
        replayed = erase_batch(image.permute(1, 2, 0)[None].float(), box, value)[0].permute(2, 0, 1)
        assert torch.equal(replayed.to(torch.uint8), erased), seed
    assert len(ops) >= 10  # most of the 14 operations were drawn


def _photo(root: Path) -> torch.Tensor:
    from PIL import Image

    return Image.open(next((root / "val" / "cat").iterdir())).convert("RGB")


# ------------------------------------------------------------------------------------------------ mixing
def test_a_batch_is_mixed_per_devices_share_from_its_position_only():
    """MixUp/CutMix draw from (seed, epoch, batch, shard): the same position mixes the same; a 2-shard batch mixed at
    once equals its halves mixed as 2 ranks would (what the parity reference replays); the caller's random state is
    left as it was; the labels become probabilities."""
    images, labels = torch.rand(8, 3, 16, 16), torch.arange(8) % 6
    mixer = BatchMixer(6, mixup_alpha=0.2, cutmix_alpha=1.0, seed=7)
    state = torch.get_rng_state()
    x, y = mixer(images, labels, epoch=1, batch=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(mixer(images, labels, 1, 3)[0], x) and not torch.equal(mixer(images, labels, 1, 4)[0], x)
    assert y.shape == (8, 6) and torch.allclose(y.sum(1), torch.ones(8))
    whole = mixer(images, labels, 1, 3, first=0, shards=2)
    halves = [mixer(images[k * 4 : k * 4 + 4], labels[k * 4 : k * 4 + 4], 1, 3, first=k) for k in (0, 1)]
    assert torch.equal(whole[0], torch.cat([h[0] for h in halves]))
    assert torch.equal(whole[1], torch.cat([h[1] for h in halves]))
    assert not torch.equal(whole[0], x)  # per shard is not the same as the whole batch at once


# ------------------------------------------------------------------------------------------------ weight decay groups
def test_norm_layers_and_biases_have_no_weight_decay_in_the_optimizers_groups():
    model = ImageClassifier(
        arch="resnet18",
        num_classes=6,
        in_channels=3,
        norm_bias_weight_decay=0.0,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=2e-5),
    )
    decayed, exempt = model.configure_optimizers().param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 2e-5 and exempt["weight_decay"] == 0.0
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    expected = {n for n in names.values() if n.rsplit(".", 1)[0] in norms or n.endswith(".bias")}
    assert {names[id(p)] for p in exempt["params"]} == expected and "net.fc.bias" in expected
    assert all(p.dim() > 1 for p in decayed["params"])  # convolutions and the classifier's weight
    assert len(decayed["params"]) + len(exempt["params"]) == len(names)
    plain = ImageClassifier(arch="resnet18", num_classes=6, in_channels=3).configure_optimizers()
    assert len(plain.param_groups) == 1  # by default: the optimizer's decay for every parameter


# ------------------------------------------------------------------------------------------------ moving average
def test_torchvisions_decay_rule():
    assert torchvision_adjusted(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600)
    assert torchvision_adjusted(0.99998, 1024, 32, 100) == pytest.approx(0.993446, abs=1e-6)
    assert torchvision_adjusted(0.9, 1024, 32, 1) == 0.0  # at most a copy


def test_the_average_is_validated_and_saved_beside_the_training_weights(mnist_dir, tmp_path):
    """MNIST, 6 steps, an average of decay 0.5: validation scores the average (validating the checkpoint's
    ``state_dict`` gives the fit's val/loss), the checkpoint holds the training weights beside it, and the model ends
    the fit holding the average."""
    pl.seed_everything(0)
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=32, num_workers=0)
    model = ImageClassifier(arch="mnist_cnn", optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = fast_trainer(
        tmp_path, callbacks=[EMA(decay=0.5), checkpoint], enable_checkpointing=True, limit_train_batches=6,
        limit_val_batches=3, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    fit_val_loss = float(trainer.callback_metrics["val/loss"])
    saved = torch.load(Path(checkpoint.last_model_path), weights_only=True)
    average, training = saved["state_dict"], saved["current_model_state"]
    assert int(saved["averaging_state"]["n_averaged"]) == 6
    assert max((average[k] - training[k]).abs().max().item() for k in average if k.endswith("weight")) > 1e-3
    assert all(torch.equal(model.state_dict()[k], average[k]) for k in average)  # the fit ended with the average
    scores = {}
    for name, state in (("average", average), ("training", training)):
        model.load_state_dict(state)
        scores[name] = fast_trainer(tmp_path, limit_val_batches=3).validate(model, datamodule=dm)[0]["val/loss"]
    assert scores["average"] == pytest.approx(fit_val_loss, rel=1e-6) and scores["training"] != scores["average"]


def test_repeated_augmentation_on_more_ranks_than_copies_gives_every_rank_a_batch():
    """1 image, 2 copies, 8 ranks: the positions are repeated to fill every rank (unequal shares would hang DDP)."""
    shards = [list(ResumableSampler(range(1), num_replicas=8, rank=r, seed=7, repeats=2)) for r in range(8)]
    assert [len(s) for s in shards] == [1] * 8 and {p for s in shards for p in s} == {0, 1}
