"""ImageNet (ILSVRC-2012) in the standard ImageFolder layout, or synthetic images of the same shape and count.

Layout of ``data_dir``::

    train/<wnid>/<image>   1,281,167 images in 1000 class folders (as the official train tars unpack)
    val/<wnid>/<image>     50,000 images; make it from the official flat folder with
                           ``python -m datamodules.imagenet_val`` (symlinks, no copies)

or a folder converted into shards by ``python -m datamodules.shards convert`` (recognised by its ``manifest.json``;
read map-style in the same order, with the same transforms: :mod:`datamodules.shards`).

Transforms are the classic ones: training RandomResizedCrop(image_size) + horizontal flip, evaluation
resize to image_size / 0.875 (256 for 224) + center crop; ImageNet mean and std. With ``normalize_on_device`` the
workers hand over uint8 tensors (4x less to collate, pin and copy) and the conversion to float and normalisation run
on the accelerator after the transfer (the prefetcher trick of the Apex ImageNet example and timm). The modern
recipe's are options (:mod:`datamodules.augment`): TrivialAugmentWide, random erasing, MixUp/CutMix, repeated
augmentation, and an evaluation resolution of its own.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from core.device import AUTO, Auto, describe, flag
from core.errors import UserError, with_link
from datamodules.augment import MEAN, STD, BatchMixer, image_transforms, mixing_line
from datamodules.base import ImageDataModule, Workers
from datamodules.decode import (
    DECODERS,
    Decoder,
    UnreadableImageError,
    _Skipped,
    decode_for,
    min_side_for,
    read,
)
from datamodules.gpu_decode import (
    BatchDecoder,
    EncodedBatch,
    collate_encoded,
    draw,
    gpu_decoding,
    input_dtype,
    nvimgcodec,
)
from datamodules.shards import PLAN, ShardDataset, is_shards, read_manifest

TRAIN_SIZE, VAL_SIZE, NUM_CLASSES = 1_281_167, 50_000, 1000
# the modern recipe's options with a range: name -> (whether a value is outside it, what the option takes)
RANGES = {
    "random_erasing": (lambda p: not 0 <= p <= 1, "a probability, from 0 (off) to 1 (0.1 in the modern recipe)"),
    "mixup_alpha": (lambda a: a < 0, "a Beta distribution's alpha, 0 (off) or more (0.2 in the modern recipe)"),
    "cutmix_alpha": (lambda a: a < 0, "a Beta distribution's alpha, 0 (off) or more (1.0 in the modern recipe)"),
    "repeated_augmentation": (lambda n: n < 1, "copies of each sample per epoch, 1 (off) or more (4 in the recipe)"),
}


class ImageNetDataError(UserError, RuntimeError):
    """The data folder is missing or not in the expected layout; the message says what to do."""


class ImageFolderChecked(ImageFolder):
    """An ``ImageFolder`` whose unreadable images stop the run naming the file, or are skipped when asked."""

    def __init__(
        self,
        root: str | Path,
        transform: Any,
        skip_unreadable: bool = False,
        decoder: Decoder = "cpu",
        min_side: int | None = None,
    ) -> None:
        super().__init__(str(root), transform=transform)
        self.skip_unreadable = skip_unreadable
        self.decoder = decoder
        self.min_side = min_side

    def __getitem__(self, index: int) -> tuple[Any, ...] | _Skipped:
        path, target = self.samples[index]
        try:
            data = read(path)  # inside: a dangling link or a failing disk is an unreadable image too
            if self.decoder == "gpu":  # the bytes and the crop's draws: the training process decodes the batch
                return data, draw(data, self.transform), target, path
            image, transform = decode_for(data, self.transform, self.decoder, self.min_side)
        except (OSError, ValueError, SyntaxError) as err:  # PIL's UnidentifiedImageError and truncation are OSErrors
            if self.skip_unreadable:
                return _Skipped(path)
            raise UnreadableImageError(
                f"cannot read image {path}: {type(err).__name__}: {err}. Replace or delete the file, or pass "
                "--data.skip_unreadable true to skip unreadable images (they are counted and reported)."
            ) from err
        return transform(image), target


def collate_skipping(batch: list) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Collates the readable samples and appends the paths of the skipped ones (stripped after the transfer)."""
    kept = [b for b in batch if not isinstance(b, _Skipped)]
    skipped = [b.path for b in batch if isinstance(b, _Skipped)]
    if not kept:
        raise UnreadableImageError(
            f"all {len(batch)} images of a batch are unreadable (e.g. {skipped[0]}): the data set looks broken."
        )
    images, labels = default_collate(kept)
    return images, labels, skipped


class SyntheticImages(Dataset):
    """``length`` random images of the final shape with random labels, for benchmarks without data.

    Samples come from a small bank of uint8 images generated once and are normalised on the device after the
    transfer, so producing, collating and copying a sample costs next to nothing: the input pipeline is taken out
    of the measurement.
    """

    def __init__(self, length: int, num_classes: int, image_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (64, 3, image_size, image_size), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.labels[index]


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # made once per device: building them from Python numbers is a blocking host-to-device copy on a GPU
    mean = torch.tensor(MEAN, device=device).view(3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(3, 1, 1) * 255
    return mean, std


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 images [N, 3, H, W] (or [3, H, W]) with values 0..255 -> float32 normalised by the ImageNet mean/std."""
    mean, std = _mean_std(images.device)
    return (images.float() - mean) / std


def classic_transforms(image_size: int, train: bool, uint8: bool, crop_ratio: float = 0.875) -> v2.Compose:
    """The ResNet paper / pytorch/examples transforms; output float normalised, or uint8 for on-device normalising."""
    return image_transforms(image_size, train, uint8, resize=round(image_size / crop_ratio))


class ImageNetDataModule(ImageDataModule):
    """ImageNet from ``data_dir/{train,val}`` (ImageFolder layout), or synthetic data of the same shape and count.

    Args:
        data_dir: folder with ``train/`` and ``val/`` class folders.
        batch_size: images per device and step (under ``dp``: per process, split across its GPUs).
        global_batch_size: if given, images per optimizer step over all processes; the per-device batch is derived
            from it and the world size (``batch_size`` is then ignored).
        num_workers: DataLoader workers per process, or ``auto`` (the node's CPUs // its training processes - 1,
            see :func:`datamodules.base.auto_workers`). The whole node's workers (x processes per node) should not
            exceed its CPUs; a warning says when they do.
        image_size: training crop, and evaluation centre crop unless ``eval_image_size`` is given (224 classic).
        eval_image_size: evaluation centre crop when it differs from the training crop (FixRes: the modern recipe
            trains at 176 and evaluates at 224).
        eval_resize_size: evaluation: the shorter side before the centre crop (default the crop / 0.875: 256 for 224).
        normalize_on_device: workers produce uint8 tensors; float conversion and normalisation happen on the device.
            ``auto``: on CUDA only.
        skip_unreadable: skip images that cannot be decoded (each rank reports how many) instead of stopping.
        synthetic: random images and labels instead of files, for benchmarks and for isolating the input pipeline
            (uint8, always normalised on the device).
        synthetic_train_size: number of synthetic training images (ImageNet's by default).
        synthetic_val_size: number of synthetic validation images (ImageNet's by default).
        num_classes: classes; by default the number of class folders in ``train/`` (1000 when synthetic).
        decode: ``cpu`` (TorchCodec for JPEGs, PIL for the rest, in the loader workers), ``pil``, ``gpu``
            (nvImageCodec decodes each batch on the training device: :mod:`datamodules.gpu_decode`), or ``auto``
            (``gpu`` on CUDA where nvImageCodec and nvJPEG load, else ``cpu``); see :mod:`datamodules.decode`. On the
            CPU, JPEGs much larger than the transform needs are decoded at reduced size.
        trivial_augment: TrivialAugmentWide per training image, after the flip (the modern recipe).
        random_erasing: random erasing's probability per training image; the box is filled with the ImageNet mean
            (0 once normalised, as torchvision's reference erases normalised images) (0: none).
        mixup_alpha: MixUp of each training batch with Beta(alpha, alpha) (0: none); with ``cutmix_alpha`` too, one
            of the two per batch, at even odds. Each device's share of the batch is mixed within itself
            (:class:`~datamodules.augment.BatchMixer`); the labels become probabilities.
        cutmix_alpha: CutMix of each training batch with Beta(alpha, alpha) (0: none).
        repeated_augmentation: each epoch loads a ``1/n``-th of the training images ``n`` times, each copy with its
            own augmentations, the copies on consecutive ranks (1: off; the modern recipe: 4).
    """

    in_channels = 3

    random_transforms = True  # RandomResizedCrop + flip: seeded per sample: a resumed run draws the same ones

    def __init__(
        self,
        data_dir: str = "data/imagenet",
        batch_size: int = 32,
        global_batch_size: int | None = None,
        num_workers: Workers = 8,
        image_size: int = 224,
        normalize_on_device: bool | Auto = AUTO,
        skip_unreadable: bool = False,
        synthetic: bool = False,
        synthetic_train_size: int = TRAIN_SIZE,
        synthetic_val_size: int = VAL_SIZE,
        num_classes: int | None = None,
        decode: Decoder = AUTO,
        eval_image_size: int | None = None,
        eval_resize_size: int | None = None,
        trivial_augment: bool = False,
        random_erasing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        repeated_augmentation: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, global_batch_size=global_batch_size, num_workers=num_workers)
        if min(image_size, eval_image_size or image_size, eval_resize_size or image_size) < 8:
            raise ValueError(
                f"data.image_size, eval_image_size and eval_resize_size must be at least 8 pixels, got {image_size}, "
                f"{eval_image_size}, {eval_resize_size}"
            )
        if decode not in DECODERS:
            raise ImageNetDataError(f"data.decode must be one of {', '.join(DECODERS)}, got {decode!r}")
        # num_classes is the model's hyperparameter (linked by the CLI); saving it here too would clash when the
        # Trainer merges both hparams (None here, the folder's count there)
        self.save_hyperparameters(ignore=["num_classes"])
        self.data_dir = Path(data_dir)
        self.skipped: list[str] = []
        self.decoder: Decoder = "cpu"  # data.decode and normalize_on_device as resolved in setup() (``auto``)
        self.normalizes_on_device = False
        self._batch_decoder: BatchDecoder | None = None
        self.repeats = repeated_augmentation
        self.mixer: BatchMixer | None = None  # made with the training loader (it needs the run's seed)
        folders = self._class_folders(self.data_dir) if not synthetic else []
        self.num_classes = num_classes or len(folders) or NUM_CLASSES
        if problems := self.config_problems(self.hparams):  # the CLI's preflight has said it already
            raise ImageNetDataError(problems[0])

    @staticmethod
    def _class_folders(data_dir: Path) -> list[str]:
        if is_shards(data_dir):
            return read_manifest(data_dir)["classes"]
        train = data_dir / "train"
        return sorted(p.name for p in train.iterdir() if p.is_dir()) if train.is_dir() else []

    @classmethod
    def config_problems(cls, init_args: Any) -> list[str]:
        """What these arguments cannot train, each with its fix (the preflight asks before the DataModule is built):
        a classifier of one class learns nothing, and torchmetrics refuses it with a traceback; an augmentation's
        probability outside [0, 1], a negative mixing alpha, fewer than one repeat."""
        problems = [
            f"data.{name}={init_args[name]} is out of range: {what}."
            for name, (wrong, what) in RANGES.items()
            if init_args.get(name) is not None and wrong(init_args[name])
        ]
        if problems or init_args.get("synthetic"):
            return problems
        folders = cls._class_folders(Path(init_args["data_dir"])) if init_args.get("data_dir") else []
        count = init_args.get("num_classes") or len(folders) or NUM_CLASSES
        if count >= 2:
            return []
        where = f"data.num_classes={count}"
        if len(folders) == 1 and not init_args.get("num_classes"):
            where = f"{(Path(init_args.get('data_dir')) / 'train').resolve()} has 1 class folder ({folders[0]})"
        return [
            with_link(
                f"{where}, but a classifier needs at least 2 classes. Fix: put each class's images in a folder of "
                "its own under train/ and val/ (train/<class>/<image>), or --data.synthetic true to run without data.",
                "one-class",
            )
        ]

    def _folder(self, split: str, train: bool) -> ImageFolderChecked | ShardDataset:
        root = self.data_dir / split
        if is_shards(self.data_dir):  # converted by `python -m datamodules.shards convert`: read the shards
            shards = ShardDataset(
                self.data_dir,
                split,
                self._transform(train),
                decoder=self.decoder,
                min_side=self._min_side(train),
                skip_unreadable=self.hparams.skip_unreadable,
            )
            if len(shards.classes) != self.num_classes:
                raise ImageNetDataError(
                    f"the shards in {self.data_dir.resolve()} hold {len(shards.classes)} classes but the model is "
                    f"built for {self.num_classes} (data.num_classes): drop data.num_classes or convert the right data"
                )
            return shards
        if (self.data_dir / PLAN).is_file():
            raise ImageNetDataError(
                f"{self.data_dir.resolve()} is an unfinished shard conversion (no manifest.json): run the same "
                "`python -m datamodules.shards convert` command again to finish it"
            )
        if not self.data_dir.is_dir():
            raise ImageNetDataError(
                f"data.data_dir {self.data_dir.resolve()} does not exist. Fix: --data.data_dir <the folder holding "
                "train/<class>/<image> and val/<class>/<image>> (`python -m datamodules.imagenet_val --help` "
                "arranges the official flat val folder), or --data.synthetic true to run without data.",
                help="data-dir-missing",
            )
        if not root.is_dir():
            raise ImageNetDataError(
                f"{root.resolve()} does not exist. data.data_dir must hold train/<class>/<image> and "
                "val/<class>/<image> (ImageFolder layout). To arrange the official flat validation folder run "
                "`python -m datamodules.imagenet_val --help`; to run without data use --data.synthetic true."
            )
        transform = self._transform(train)
        try:
            dataset = ImageFolderChecked(
                root,
                transform,
                skip_unreadable=self.hparams.skip_unreadable,
                decoder=self.decoder,
                min_side=self._min_side(train),
            )
        except FileNotFoundError as err:  # ImageFolder: no class folder or no image in one
            said = str(err).rstrip(".")
            said = said if str(root) in said else f"{root.resolve()}: {said}"  # "no valid file" names no folder
            raise ImageNetDataError(
                f"{said}. Each class needs a folder with its images, {split}/<class>/<image> (ImageFolder layout).",
                help="no-class-folder",
            ) from err
        if len(dataset.classes) != self.num_classes:
            raise ImageNetDataError(
                f"{root.resolve()} has {len(dataset.classes)} class folders but the model is built for "
                f"{self.num_classes} classes (data.num_classes or the class folders of train/). Make train/ and "
                "val/ hold the same class folders.",
                help="one-class" if len(dataset.classes) == 1 else None,  # one folder: a split of one class
            )
        return dataset

    def _eval_sizes(self) -> tuple[int, int]:
        """Evaluation's centre crop and the shorter side resized to before it."""
        crop = self.hparams.eval_image_size or self.hparams.image_size
        return crop, self.hparams.eval_resize_size or round(crop / 0.875)

    def _transform(self, train: bool) -> v2.Compose:
        # uint8 when normalised on the device; always under decode gpu (only its draws are used, in the workers)
        uint8 = self.normalizes_on_device or self.decoder == "gpu"
        if not train:
            crop, resize = self._eval_sizes()
            return image_transforms(crop, False, uint8, resize=resize)
        h = self.hparams
        return image_transforms(h.image_size, True, uint8, trivial=h.trivial_augment, erasing=h.random_erasing)

    def _min_side(self, train: bool) -> int:
        """The shortest source side the transform uses whole: reduced-size decoding keeps at least this much."""
        return min_side_for(self.hparams.image_size, True) if train else self._eval_sizes()[1]

    def _device(self) -> torch.device:
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @staticmethod
    def _decoder_for(decode: str, cuda: bool) -> tuple[Decoder, str]:
        """The decoder ``data.decode`` gives on this device, and why (``auto``'s choice, as the plan says it)."""
        if decode != AUTO:
            return decode, f"data.decode {decode}"  # type: ignore[return-value]
        gpu, why = gpu_decoding(cuda)
        return ("gpu" if gpu else "cpu"), f"data.decode auto: {why}"

    def _resolve_auto(self) -> None:
        """``data.decode`` and ``normalize_on_device`` on this rank's device; ``gpu`` needs nvImageCodec."""
        cuda = self._device().type == "cuda"
        self.decoder, why = self._decoder_for(self.hparams.decode, cuda)
        self.normalizes_on_device = flag(self.hparams.normalize_on_device, cuda)
        if self.decoder != "gpu":
            return
        usable, problem = gpu_decoding(True)  # on CUDA its GPU decoders need nvJPEG; elsewhere its CPU backend
        if nvimgcodec()[0] is None or (cuda and not usable):
            raise ImageNetDataError(f"{why}: {problem}; or --data.decode cpu (TorchCodec, portable).")

    @classmethod
    def plan_lines(cls, init_args: Any, cuda: bool) -> list[str]:
        """What the plan says of this data before anything is built: the decoder and where normalising runs, and the
        modern recipe's choices when they are on (augmentations and where they run, mixing, the sampler)."""
        if init_args.get("synthetic"):
            return ["data         synthetic uint8 images, normalised on the device", *cls._recipe_lines(init_args)]
        decoder, why = cls._decoder_for(init_args.get("decode", AUTO), cuda)
        given = init_args.get("normalize_on_device", AUTO)
        if decoder == "gpu":
            module = nvimgcodec()[0]
            version = module.__version__ if module else "(not installed)"
            where = "the training device" if cuda else "the CPU (its CPU backend)"
            return [
                f"decode       gpu: nvImageCodec {version} on {where}; the loader workers read bytes, draw the crops "
                f"({why})",
                "normalise    on the device, with the decoding (data.decode gpu)",
                *cls._recipe_lines(init_args, decoder),
            ]
        engine = _torchcodec_version() if decoder == "cpu" else "PIL"
        where = "on the device" if flag(given, cuda) else "in the loader workers"
        return [
            f"decode       {decoder}: {engine} in the loader workers ({why})",
            f"normalise    {describe('data.normalize_on_device', given, where, cuda)}",
            *cls._recipe_lines(init_args, decoder),
        ]

    @staticmethod
    def _recipe_lines(init_args: Any, decoder: str | None = None) -> list[str]:
        """The plan's lines for the options beyond the classic recipe, each only when it is on."""
        lines = []
        named = [n for n, on in (("TrivialAugmentWide", init_args.get("trivial_augment")),
                                 (f"random erasing {init_args.get('random_erasing')}", init_args.get("random_erasing")))
                 if on]  # fmt: skip
        if named and decoder is not None:
            where = (
                "applied on the device after decoding, image by image (data.decode gpu)"
                if decoder == "gpu"
                else "applied there"
            )
            lines.append(
                f"augment      {', '.join(named)} per image: drawn in the loader workers (per sample), {where}"
            )
        mixup, cutmix = init_args.get("mixup_alpha") or 0.0, init_args.get("cutmix_alpha") or 0.0
        if mixup or cutmix:
            lines.append(mixing_line(mixup, cutmix))
        repeats = init_args.get("repeated_augmentation") or 1
        if repeats > 1:
            lines.append(
                f"sampler      repeated augmentation x{repeats}: each epoch loads 1/{repeats} of the images {repeats} "
                "times, each copy augmented on its own, the copies on consecutive ranks; its position is saved in "
                "checkpoints (data.repeated_augmentation)"
            )
        crop, resize = init_args.get("eval_image_size"), init_args.get("eval_resize_size")
        if crop or resize:
            size = init_args.get("image_size", 224)
            crop = crop or size
            lines.append(
                f"evaluate     resize {resize or round(crop / 0.875)}, centre crop {crop}; training crops {size} "
                "(data.eval_image_size, data.eval_resize_size)"
            )
        return lines

    def setup(self, stage: str | None = None) -> None:
        # here, not in __init__: the CLI wraps an __init__ error into its own long message
        self._resolve_auto()
        super().setup(stage)
        size = self.hparams.image_size
        if self.hparams.synthetic:
            if getattr(self, "val_set", None) is None:
                self.train_set = SyntheticImages(self.hparams.synthetic_train_size, self.num_classes, size, seed=0)
                self.val_set = SyntheticImages(self.hparams.synthetic_val_size, self.num_classes, size, seed=1)
        else:
            if getattr(self, "val_set", None) is None:
                self.val_set = self._folder("val", train=False)
            if stage in ("fit", None) and getattr(self, "train_set", None) is None:
                self.train_set = self._folder("train", train=True)
                if self.train_set.classes != self.val_set.classes:
                    only = sorted(set(self.train_set.classes) ^ set(self.val_set.classes))
                    raise ImageNetDataError(
                        f"train/ and val/ in {self.data_dir.resolve()} have different class folders (in one only: "
                        f"{', '.join(only[:5])}{' ...' if len(only) > 5 else ''}); the labels would not match.",
                        help="different-class-folders",
                    )
        train = getattr(self, "train_set", None)
        rank_zero_info(
            f"ImageNet data ({'synthetic' if self.hparams.synthetic else self.data_dir}"
            f"{', shards' if is_shards(self.data_dir) and not self.hparams.synthetic else ''}): "
            f"{len(train) if train is not None else '-'} training and {len(self.val_set)} validation images, "
            f"{self.num_classes} classes, {size}px, {self.batch_size} per device"
        )

    def _collate(self) -> dict[str, Any]:
        if self.decoder == "gpu" and not self.hparams.synthetic:
            return {"collate_fn": collate_encoded}
        return {"collate_fn": collate_skipping} if self.hparams.skip_unreadable and not self.hparams.synthetic else {}

    def train_dataloader(self) -> DataLoader:
        if getattr(self, "train_set", None) is None:
            raise ImageNetDataError("setup('fit') was not run: no training set")
        loader = self._loader(self.train_set, train=True, drop_last=True, **self._collate())
        h = self.hparams
        if h.mixup_alpha or h.cutmix_alpha:
            self.mixer = BatchMixer(self.num_classes, h.mixup_alpha, h.cutmix_alpha, self.train_seed)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False, **self._collate())

    def test_dataloader(self) -> DataLoader:  # ImageNet's test labels are not public: test on val
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One image, channels first: the model summary's example input (its FLOPs column)."""
        return (self.in_channels, self.hparams.image_size, self.hparams.image_size)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, EncodedBatch):
            return batch
        if self._batch_decoder is None:  # made on first use, on this rank's device
            skip = self.hparams.skip_unreadable
            self._batch_decoder = BatchDecoder(self._device(), skip_unreadable=skip)
        precision = str(self.trainer.precision) if self.trainer is not None else "32-true"
        images, labels = self._batch_decoder(batch, input_dtype(precision))
        return (images, labels, batch.skipped) if batch.skipped else (images, labels)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, torch.Tensor):  # the model summary's example input: float images, no labels
            return batch
        images, labels, *rest = batch
        if rest:
            self._note_skipped(rest[0])
        if images.dtype == torch.uint8:
            # Lightning casts a batch to the precision's input dtype before this hook, when it is still uint8: the
            # normalised images are made in it here, as the GPU decoder makes them (bf16 for bf16-mixed: every input
            # path hands the step the same dtype, so a compiled step has one graph)
            precision = str(self.trainer.precision) if self.trainer is not None else "32-true"
            images = normalize(images).to(input_dtype(precision))
        if self.mixer is not None and self.trainer is not None and self.trainer.training:
            # the batch's position: the epoch and this batch's index in it (the training loop counts it ready after
            # this hook), restored with the loop on a resume
            epoch, batch_index = (
                self.trainer.current_epoch,
                self.trainer.fit_loop.epoch_loop.batch_progress.current.ready,
            )
            images, labels = self.mixer(images, labels, epoch, batch_index, *self.batch_shards())
        return images, labels

    def _note_skipped(self, paths: list[str]) -> None:
        if paths and not self.skipped:
            warnings.warn(f"skipping unreadable image {paths[0]} (--data.skip_unreadable true)", stacklevel=2)
        self.skipped.extend(paths)

    def teardown(self, stage: str) -> None:
        decoded = self._batch_decoder
        if decoded is not None:
            self.skipped += decoded.skipped
            if decoded.fallbacks:
                rank = self.trainer.global_rank if self.trainer is not None else 0
                warnings.warn(
                    f"rank {rank}: {len(decoded.fallbacks)} image(s) nvImageCodec could not decode were decoded on the "
                    f"CPU instead, e.g. {decoded.fallbacks[0]}",
                    stacklevel=2,
                )
            decoded.skipped, decoded.fallbacks = [], []
        if self.skipped:
            rank = self.trainer.global_rank if self.trainer is not None else 0
            stage = getattr(stage, "value", stage)  # the Trainer passes its TrainerFn enum
            warnings.warn(
                f"rank {rank}: skipped {len(self.skipped)} unreadable image(s) during {stage}, e.g. {self.skipped[0]}",
                stacklevel=2,
            )
            self.skipped = []


def _torchcodec_version() -> str:
    try:
        return f"TorchCodec {importlib.metadata.version('torchcodec')}"
    except importlib.metadata.PackageNotFoundError:
        return "PIL (TorchCodec not installed)"
