"""ImageNet datamodule on a tiny real-photo ImageFolder built from the photos shipped inside PyPI wheels."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from core.batch import resolve_batch
from datamodules.augment import MEAN, STD
from datamodules.base import normalize, workers_warning
from datamodules.decode import UnreadableImageError
from datamodules.imagenet import ImageNetDataError, ImageNetDataModule
from modules import ImageClassifier
from tools.photos import build_photo_imagenet


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return build_photo_imagenet(tmp_path_factory.mktemp("imagenet"))


def _trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def test_layout_classes_and_classic_transforms(photos):
    dm = ImageNetDataModule(data_dir=str(photos), batch_size=4, num_workers=0, image_size=64)
    assert dm.num_classes == 6  # counted from the class folders at construction, so the CLI can link it
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (18, 9)
    assert dm.train_set.classes == ["cat", "coffee_mug", "motorcycle", "person", "rocket", "scenery"]
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 64, 64) and x.dtype == torch.float32 and y.tolist() == [0, 1, 2, 2]
    # normalised with the ImageNet statistics: a real photo lands roughly around 0 with unit spread
    assert -1.5 < x.mean().item() < 1.5 and 0.3 < x.std().item() < 2.0
    train_loader = dm.train_dataloader()
    assert train_loader.drop_last and len(train_loader) == 4  # 18 images, batch 4: the incomplete batch is dropped


def test_uint8_pipeline_normalises_on_device_to_the_same_values(photos):
    as_float = ImageNetDataModule(data_dir=str(photos), batch_size=9, num_workers=0, image_size=48)
    as_uint8 = ImageNetDataModule(
        data_dir=str(photos), batch_size=9, num_workers=0, image_size=48, normalize_on_device=True
    )
    for dm in (as_float, as_uint8):
        dm.setup("validate")
    x_float, y_float = next(iter(as_float.val_dataloader()))
    raw, y_raw = next(iter(as_uint8.val_dataloader()))
    assert raw.dtype == torch.uint8 and raw.element_size() * 4 == x_float.element_size()  # 4x fewer bytes to move
    x_dev, y_dev = as_uint8.on_after_batch_transfer((raw, y_raw), 0)
    assert torch.equal(y_dev, y_float)
    # the same crop, normalised after the transfer: equal up to float rounding (1/255 steps differ by 0.017)
    assert (x_dev - x_float).abs().max().item() < 1e-4


@pytest.mark.slow
def test_fit_and_validate_resnet18_on_real_photos(photos, tmp_path):
    torch.manual_seed(0)
    dm = ImageNetDataModule(data_dir=str(photos), batch_size=6, num_workers=0, image_size=32)
    model = ImageClassifier(
        arch="resnet18",
        num_classes=dm.num_classes,
        in_channels=3,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    )
    initial = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3  # 18 training photos, batch 6
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    metrics = trainer.validate(model, datamodule=dm, verbose=False)[0]
    assert model.evaluated["val"] == (9, 9)  # every photo evaluated exactly once
    # the reported metrics are those of the 9 photos, recomputed here by hand from the model's predictions
    model.eval()
    with torch.no_grad():
        batches = list(dm.val_dataloader())
        logits = torch.cat([model(x) for x, _ in batches])
        labels = torch.cat([y for _, y in batches])
    assert metrics["val/acc1"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    assert metrics["val/loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert metrics["val/acc5"] >= metrics["val/acc1"]


@pytest.mark.slow
def test_synthetic_mode_resnet50_few_steps(tmp_path):
    dm = ImageNetDataModule(synthetic=True, batch_size=2, num_workers=0)
    assert dm.num_classes == 1000
    dm.setup("fit")
    # the right shape and count: ImageNet's 1,281,167 training and 50,000 validation images at 224 px
    assert (len(dm.train_set), len(dm.val_set)) == (1_281_167, 50_000)
    x, y = dm.train_set[123]
    assert x.shape == (3, 224, 224) and x.dtype == torch.uint8 and 0 <= int(y) < 1000  # normalised on the device
    # training resnet50 at 224 px costs ~5 s per step on a CPU: the steps run at 64 px
    dm = ImageNetDataModule(synthetic=True, batch_size=2, num_workers=0, image_size=64)
    model = ImageClassifier(arch="resnet50", num_classes=1000, in_channels=3, channels_last=True)
    trainer = _trainer(tmp_path, max_steps=3, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert model.evaluated["val"] == (2, 50_000)  # limit_val_batches=1: the report says it saw only part
    assert model.net.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_unreadable_image_stops_naming_the_file(photos, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(photos, root)
    bad = root / "val" / "rocket" / "truncated.jpg"
    bad.write_bytes((photos / "val" / "rocket" / "rocket.jpg").read_bytes()[:300])
    dm = ImageNetDataModule(data_dir=str(root), batch_size=10, num_workers=0, image_size=32)
    dm.setup("validate")
    with pytest.raises(UnreadableImageError, match=f"cannot read image {bad}.*--data.skip_unreadable true"):
        next(iter(dm.val_dataloader()))

    skipping = ImageNetDataModule(data_dir=str(root), batch_size=4, num_workers=0, image_size=32, skip_unreadable=True)
    model = ImageClassifier(arch="resnet18", num_classes=6, in_channels=3)
    with (
        pytest.warns(UserWarning, match=r"skipping unreadable image .*truncated\.jpg"),  # when met, then in sum:
        pytest.warns(UserWarning, match=r"skipped 1 unreadable image\(s\) during validate, e\.g\. .*truncated\.jpg"),
    ):
        _trainer(tmp_path).validate(model, datamodule=skipping, verbose=False)
    assert model.evaluated["val"] == (9, 10)  # the 9 readable photos, out of 10 files


def test_missing_folder_says_what_layout_is_expected(tmp_path):
    dm = ImageNetDataModule(data_dir=str(tmp_path / "nowhere"), num_workers=0)
    assert dm.num_classes == 1000  # a config can be instantiated before the data exists
    with pytest.raises(ImageNetDataError, match="train/<class>/<image>.*imagenet_val.*--data.synthetic true"):
        dm.setup("fit")


def test_global_batch_size_is_split_or_refused_naming_every_factor():
    assert resolve_batch(32, None, world_size=8).global_batch == 256
    plan = resolve_batch(999, 1024, world_size=16, accumulate_grad_batches=2, num_nodes=2)
    assert (plan.per_device, plan.global_batch) == (32, 1024)
    with pytest.raises(ValueError) as err:
        resolve_batch(32, 1000, world_size=16, accumulate_grad_batches=2, num_nodes=2)
    message = str(err.value)
    for part in (
        "global_batch_size=1000",
        "world size 16 (8 processes per node x 2 nodes)",
        "accumulate_grad_batches 2 = 32",
        "992 or 1024",
        "data.batch_size",
    ):
        assert part in message, (part, message)


def test_global_batch_size_drives_the_per_device_batch_and_the_lr(tmp_path):
    dm = ImageNetDataModule(
        synthetic=True, global_batch_size=12, synthetic_train_size=48, num_workers=0, image_size=28, num_classes=10
    )
    model = ImageClassifier(
        arch="mnist_cnn",
        num_classes=10,
        in_channels=3,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        lr_reference_batch_size=256,
    )
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0, accumulate_grad_batches=3)
    trainer.fit(model, datamodule=dm)
    assert dm.batch_size == 4 and dm.global_batch_size == 12  # 12 / (1 process x 3 accumulated)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 12 / 256)


def test_too_many_workers_warns():
    assert workers_warning(4, processes_per_node=2, cpus=8) is None
    message = workers_warning(8, processes_per_node=8, cpus=16)
    assert "8 x 8 process(es) on this node = 64 loader workers for 16 CPUs" in message
    assert "--data.num_workers 1 or fewer" in message


def test_too_many_workers_warns_at_setup(photos, tmp_path):
    dm = ImageNetDataModule(data_dir=str(photos), num_workers=os.cpu_count() * 4 + 1)
    dm.trainer = _trainer(tmp_path)
    with pytest.warns(UserWarning, match="loader workers for .* CPUs"):
        dm.setup("validate")


def test_normalize_matches_the_imagenet_statistics():
    pixel = torch.tensor([[[124]], [[116]], [[104]]], dtype=torch.uint8)
    expected = (torch.tensor([124, 116, 104]) / 255 - torch.tensor(MEAN)) / torch.tensor(STD)
    assert torch.allclose(normalize(pixel).flatten(), expected, atol=1e-6)


def test_mnist_gets_the_same_exact_evaluation_and_batch_semantics(mnist_dir, tmp_path):
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    from datamodules import MNISTDataModule

    # a 2-process DDP trainer as rank 0 sees it (nothing is launched before fit/validate)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, default_root_dir=tmp_path)
    dm = MNISTDataModule(data_dir=str(mnist_dir), val_size=4999, global_batch_size=64)
    dm.trainer = trainer
    dm.setup("fit")
    assert (dm.batch_size, dm.global_batch_size) == (32, 64)  # 64 over 2 processes
    sampler = dm.val_dataloader().sampler
    assert isinstance(sampler, UnrepeatedDistributedSampler)  # Lightning leaves a DistributedSampler in place
    assert list(sampler) == list(range(0, 4999, 2))  # rank 0's share: 2500 of 4999, no padding duplicate
    assert not isinstance(dm.train_dataloader().sampler, UnrepeatedDistributedSampler)  # training: Lightning's


def test_warmup_ramps_the_lr_then_hands_back_to_the_scheduler(tmp_path):
    seen = []

    class RecordLR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(round(optimizer.param_groups[0]["lr"], 6))

    dm = ImageNetDataModule(
        synthetic=True, batch_size=2, synthetic_train_size=8, num_workers=0, image_size=28, num_classes=4
    )
    model = ImageClassifier(
        arch="mnist_cnn",
        num_classes=4,
        in_channels=3,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.4),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        warmup_epochs=1,
    )
    trainer = _trainer(tmp_path, max_epochs=2, limit_val_batches=0, callbacks=[RecordLR()])
    trainer.fit(model, datamodule=dm)
    # 4 steps per epoch: warmup 1/4 .. 4/4 of 0.4 in epoch 0, then StepLR's decayed 0.2 untouched in epoch 1
    assert seen == [0.1, 0.2, 0.3, 0.4, 0.2, 0.2, 0.2, 0.2]


def test_compile_keeps_checkpoint_keys():
    # compiling runs at the first forward (minutes on a CPU, so not here); checkpoints must not see a wrapper
    plain, compiled = ImageClassifier(arch="mnist_cnn"), ImageClassifier(arch="mnist_cnn", compile=True)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    compiled.load_state_dict(plain.state_dict())


def test_an_image_that_cannot_be_opened_stops_naming_the_file_or_is_skipped(photos, tmp_path):
    """A dangling link (a file moved on shared storage) fails in the read itself, before any decode."""
    root = tmp_path / "dangling"
    shutil.copytree(photos, root)
    gone = root / "val" / "rocket" / "moved.jpg"
    gone.symlink_to(tmp_path / "no-such-file.jpg")
    dm = ImageNetDataModule(data_dir=str(root), batch_size=11, num_workers=0, image_size=32)
    dm.setup("validate")
    with pytest.raises(UnreadableImageError, match=f"cannot read image {gone}: FileNotFoundError.*skip_unreadable"):
        next(iter(dm.val_dataloader()))
    skipping = ImageNetDataModule(data_dir=str(root), batch_size=11, num_workers=0, image_size=32, skip_unreadable=True)
    skipping.setup("validate")
    images, labels, skipped = next(iter(skipping.val_dataloader()))
    assert len(labels) == 9 and [str(p) for p in skipped] == [str(gone)]  # the 9 photos, out of 10 files
