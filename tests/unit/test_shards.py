"""Shards on real data: the test photos and a few hundred JPEG crops cut from them, converted and read back."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image

from datamodules.imagenet import ImageNetDataError, ImageNetDataModule, classic_transforms
from datamodules.resumable import ResumableSampler
from datamodules.shards import Options, ShardDataset, ShardsError, convert, main
from modules import ImageClassifier
from tests.conftest import ROOT
from tools.photos import build_photo_imagenet, photo_sources


def build_crops(root: Path, per_class: int = 40, val_per_class: int = 5, size: tuple[int, int] = (160, 120)) -> Path:
    """``root/{train,val}/<class>/*.jpg``: random crops (scale, position, flip) of each class's real photos."""
    rng = random.Random(0)
    for cls, files in photo_sources().items():
        photos = [Image.open(f).convert("RGB") for f in files]
        for split, count in (("train", per_class), ("val", val_per_class)):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                photo = rng.choice(photos)
                w, h = rng.randint(size[0] // 2, photo.width // 2), rng.randint(size[1] // 2, photo.height // 2)
                left, top = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
                crop = photo.crop((left, top, left + w, top + h))
                crop.thumbnail(size)
                if rng.random() < 0.5:
                    crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                crop.save(root / split / cls / f"{cls}_{i:03d}.jpg", quality=85)
    return root


@pytest.fixture(scope="module")
def crops(tmp_path_factory) -> Path:
    return build_crops(tmp_path_factory.mktemp("crops"))  # 240 training and 30 validation JPEGs in 6 classes


@pytest.fixture(scope="module")
def converted(crops, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("shards") / "out"
    convert(crops, dst, Options(shard_images=50), workers=2, progress=False)
    return dst


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_convert_writes_shuffled_shards_a_manifest_and_the_source_bytes(crops, converted, tmp_path):
    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["classes"] == sorted(photo_sources())  # labels from the sorted class folders
    assert manifest["source"] == str(crops.resolve()) and manifest["options"]["shard_images"] == 50
    train = manifest["splits"]["train"]
    assert train["images"] == 240 and [s["images"] for s in train["shards"]] == [50, 50, 50, 50, 40]
    assert all(_sha(converted / "train" / s["file"]) == s["sha256"] for s in train["shards"])
    with tarfile.open(converted / "train" / "shard-00000.tar") as tar:  # the WebDataset layout, any tar reads it
        names = tar.getnames()
        first_label = int(tar.extractfile(names[1]).read())
    assert names[0].endswith(".jpg") and names[1] == names[0].replace(".jpg", ".cls")
    assert first_label == manifest["classes"].index(names[0].split("/")[0])
    stems = [n for n in names if n.endswith(".jpg")]
    assert stems != sorted(stems)  # shuffled, not in folder order
    # reading gives back each source file's bytes and ImageFolder's label, in ImageFolder's order
    train_transform = classic_transforms(32, train=True, uint8=True)
    dataset = ShardDataset(converted, "train", transform=train_transform, decoder="gpu")  # gpu: the bytes (+ a crop)
    files = sorted((crops / "train").rglob("*.jpg"))
    for index in (0, 1, 117, 239):
        data, _, label, _ = dataset[index]
        assert data == files[index].read_bytes()
        assert manifest["classes"][label] == files[index].parent.name
    assert dataset.files_opened == len({int(dataset.index[i][0]) for i in (0, 1, 117, 239)})
    # one seeded order: converting again gives the same shards, byte for byte
    again = convert(crops, tmp_path / "again", Options(shard_images=50), workers=1, progress=False)
    assert [s["sha256"] for s in again["splits"]["train"]["shards"]] == [s["sha256"] for s in train["shards"]]


def test_max_side_reencodes_the_larger_images(tmp_path):
    src = build_photo_imagenet(tmp_path / "photos", max_side=192)
    manifest = convert(src, tmp_path / "small", Options(max_side=100, shard_images=8), progress=False)
    dataset = ShardDataset(tmp_path / "small", "val", transform=lambda image: image, decoder="pil")
    assert manifest["options"]["max_side"] == 100 and len(dataset) == 9
    assert all(max(dataset[i][0].size) == 100 for i in range(len(dataset)))  # every photo was larger than 100


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["convert", *args, "--no-progress", "--workers", "1"])
    return code, capsys.readouterr().err.strip()


def test_bad_inputs_each_give_one_line_and_lose_nothing(crops, tmp_path, capsys):
    code, err = _cli(capsys, "--src", str(tmp_path / "nowhere"), "--dst", str(tmp_path / "a"))
    assert code == 1 and err == f"error: --src {tmp_path / 'nowhere'} does not exist: give the folder holding " + (
        "train/<class>/<image> and val/..."
    )
    (tmp_path / "empty").mkdir()
    code, err = _cli(capsys, "--src", str(tmp_path / "empty"), "--dst", str(tmp_path / "a"))
    assert code == 1 and err.startswith(f"error: --src {tmp_path / 'empty'} is empty")
    flat = tmp_path / "flat"
    for split in ("train", "val"):
        (flat / split).mkdir(parents=True)
        (flat / split / "x.jpg").write_bytes((crops / "train" / "cat" / "cat_000.jpg").read_bytes())
    code, err = _cli(capsys, "--src", str(flat), "--dst", str(tmp_path / "a"))
    assert code == 1 and err.startswith(f"error: {flat / 'train'} is not a class layout: Couldn't find any class")
    assert not (tmp_path / "a").exists()  # nothing written for a refused source
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    code, err = _cli(capsys, "--src", str(crops), "--dst", str(foreign))
    assert code == 1 and "is not empty and holds no conversion" in err and len(err.splitlines()) == 1
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "precious"


def test_unreadable_image_is_listed_and_skipped(tmp_path, capsys):
    src = build_photo_imagenet(tmp_path / "photos", max_side=96)
    bad = src / "train" / "rocket" / "truncated.jpg"
    bad.write_bytes((src / "train" / "rocket" / "rocket.jpg").read_bytes()[:300])
    code = main(["convert", "--src", str(src), "--dst", str(tmp_path / "out"), "--no-progress", "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "train: 18 images in 1 shards" in out and "1 unreadable skipped" in out
    assert "skipped train/rocket/truncated.jpg: OSError" in out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["source_images"] == 19 and len(manifest["splits"]["train"]["skipped"]) == 1


def test_killed_conversion_never_looks_complete_and_a_rerun_finishes(crops, converted, tmp_path):
    dst = tmp_path / "killed"
    command = [sys.executable, "-m", "datamodules.shards", "convert", "--src", str(crops), "--dst", str(dst)]
    command += ["--shard-images", "10", "--workers", "1", "--no-progress", "--max-side", "64"]
    job = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not (dst / "train" / "shard-00001.json").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL, "the conversion finished before it could be killed"
    assert not (dst / "manifest.json").exists()
    with pytest.raises(ImageNetDataError, match="unfinished shard conversion .* run the same"):
        ImageNetDataModule(data_dir=str(dst), num_workers=0).setup("fit")
    manifest = convert(crops, dst, Options(max_side=64, shard_images=10), progress=False)
    assert manifest["splits"]["train"]["images"] == 240 and not list(dst.rglob(".*.tmp"))
    whole = convert(crops, tmp_path / "whole", Options(max_side=64, shard_images=10), progress=False)
    assert manifest["splits"] == whole["splits"]  # the same shards, checksums included, as without the kill


def test_every_image_every_epoch_under_a_global_shuffle_and_few_files_opened(converted):
    # the litdata trap this format avoids: chunk windows per worker that skip the same images every epoch. The
    # sampler is the one the app's training loader uses (datamodules.base.ImageDataModule._loader)
    dataset = ShardDataset(converted, "train", transform=classic_transforms(32, True, uint8=True), decoder="gpu")
    epochs = []
    for epoch in range(2):
        seen = []
        for rank in range(2):
            sampler = ResumableSampler(dataset, num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            seen += list(sampler)
        assert sorted(seen) == list(range(240))
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    for index in epochs[0]:
        dataset[index]
    assert dataset.files_opened == 5  # one open per shard, not one per image


NETWORK = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.bind", "socket.sendto"}


def test_converting_and_reading_make_no_network_call_and_open_nothing_before_setup(crops, tmp_path):
    events: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event in NETWORK and recording:  # (socket.gethostname, which the launcher detection reads, is local)
            events.append(event)

    recording = True
    sys.addaudithook(audit)  # real audit events of the interpreter (they cannot be removed: `recording` stops it)
    try:
        converted = tmp_path / "out"
        convert(crops, converted, Options(shard_images=100), workers=1, progress=False)
        dm = ImageNetDataModule(data_dir=str(converted), batch_size=8, num_workers=0, image_size=32)
        assert not hasattr(dm, "train_set")  # datasets are built in setup(), after the process group exists
        dm.setup("fit")
        images, labels = next(iter(dm.train_dataloader()))
    finally:
        recording = False
    assert images.shape == (8, 3, 32, 32) and events == []


def _fit(data_dir: Path, tmp_path: Path) -> dict[str, float]:
    pl.seed_everything(0, verbose=False)
    dm = ImageNetDataModule(data_dir=str(data_dir), batch_size=8, num_workers=0, image_size=32)
    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    model = ImageClassifier(arch="resnet18", num_classes=6, in_channels=3, optimizer=sgd)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


@pytest.mark.slow
def test_folder_and_shards_give_the_same_metrics(crops, converted, tmp_path):
    folder, shards = _fit(crops, tmp_path / "a"), _fit(converted, tmp_path / "b")
    assert set(folder) >= {"val/acc1", "val/loss"}
    for key, value in folder.items():  # same seed, same images, same order: equal up to float noise
        assert shards[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_reader_refuses_a_folder_that_is_not_converted(tmp_path):
    with pytest.raises(ShardsError, match="no manifest.json: an unfinished conversion"):
        ShardDataset(tmp_path, "train", transform=None)


def test_bench_shards_smoke(tmp_path):
    from bench import loader

    result = loader.main(["--shards", "--images", "10", "--rounds", "1", "--fit-steps", "0", "--out", str(tmp_path)])
    assert (tmp_path / "loader_shards.md").is_file() and json.loads((tmp_path / "loader_shards.json").read_text())
    rows = {(r["source"], r["variant"], r["decoder"]): r for r in result["rows"]}
    assert len(rows) == 12 and all(r["img_per_s_per_core"] > 0 for r in rows.values())
    assert rows["large", "folder", "pil"]["files_opened_per_epoch"] == 10  # one open per image
    assert rows["large", "shards --max-side 512", "torchcodec"]["files_opened_per_epoch"] == 1  # one shard
    assert {c["variant"] for c in result["conversion"]} == {"shards", "shards --max-side 512"}


def test_slurm_tasks_split_the_shards_and_the_last_one_writes_the_manifest(crops, converted, tmp_path, capsys):
    dst = tmp_path / "tasks"
    args = ["convert", "--src", str(crops), "--dst", str(dst), "--shard-images", "50", "--no-progress"]
    args += ["--workers", "1"]
    assert main([*args, "--task-index", "1", "--num-tasks", "2"]) == 0  # as srun's second task (SLURM_PROCID 1)
    assert "task 1/2: its shards are written; the last task to finish writes" in capsys.readouterr().out
    assert not (dst / "manifest.json").exists()
    assert sorted(p.name for p in (dst / "train").glob("*.tar")) == ["shard-00001.tar", "shard-00003.tar"]
    assert main([*args, "--task-index", "0", "--num-tasks", "2"]) == 0
    assert f"complete: {dst / 'manifest.json'}" in capsys.readouterr().out
    split = json.loads((dst / "manifest.json").read_text())["splits"]
    assert split == json.loads((converted / "manifest.json").read_text())["splits"]  # as one task would have made
