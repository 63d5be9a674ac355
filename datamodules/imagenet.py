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

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from core.device import AUTO, Auto
from core.errors import UserError, with_link
from datamodules.augment import MIXING_RANGES, image_transforms, range_problems, recipe_lines
from datamodules.base import ImageDataModule, Workers
from datamodules.decode import DECODERS, Decoder, min_side_for
from datamodules.shards import PLAN, ShardDataset, is_shards, read_manifest
from datamodules.sources import (
    ImageFolderChecked,
    SyntheticImages,
    choose_decoder,
    collate,
    decode_line,
    decoder_problem,
)

TRAIN_SIZE, VAL_SIZE, NUM_CLASSES = 1_281_167, 50_000, 1000
# the modern recipe's options with a range: name -> (whether a value is outside it, what the option takes)
RANGES = {
    "random_erasing": (lambda p: not 0 <= p <= 1, "a probability, from 0 (off) to 1 (0.1 in the modern recipe)"),
    **MIXING_RANGES,
    "repeated_augmentation": (lambda n: n < 1, "copies of each sample per epoch, 1 (off) or more (4 in the recipe)"),
}


class ImageNetDataError(UserError, RuntimeError):
    """The data folder is missing or not in the expected layout; the message says what to do."""


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
        super().__init__(batch_size, global_batch_size, num_workers, normalize_on_device, mixup_alpha, cutmix_alpha)
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
        self.decoder: Decoder = "cpu"  # data.decode as resolved in setup() (``auto``)
        self.skip_unreadable = skip_unreadable
        self.repeats = repeated_augmentation
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
        problems = range_problems(RANGES, init_args)
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
        """The split's source: the shards of a converted folder, else its class folders."""
        options = dict(decoder=self.decoder, min_side=self._min_side(train), skip_unreadable=self.skip_unreadable)
        if is_shards(self.data_dir):  # converted by `python -m datamodules.shards convert`: read the shards
            shards = ShardDataset(self.data_dir, split, self._transform(train), **options)
            if len(shards.classes) != self.num_classes:
                raise ImageNetDataError(
                    f"the shards in {self.data_dir.resolve()} hold {len(shards.classes)} classes but the model is "
                    f"built for {self.num_classes} (data.num_classes): drop data.num_classes or convert the right data"
                )
            return shards
        root = self._split_root(split)
        try:
            dataset = ImageFolderChecked(root, self._transform(train), **options)
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

    def _split_root(self, split: str) -> Path:
        """``data_dir/split``, or the error that says what the data folder lacks."""
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
        root = self.data_dir / split
        if not root.is_dir():
            raise ImageNetDataError(
                f"{root.resolve()} does not exist. data.data_dir must hold train/<class>/<image> and "
                "val/<class>/<image> (ImageFolder layout). To arrange the official flat validation folder run "
                "`python -m datamodules.imagenet_val --help`; to run without data use --data.synthetic true."
            )
        return root

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

    def _resolve_decoder(self) -> None:
        """``data.decode`` on this rank's device (``auto``); ``gpu`` needs nvImageCodec."""
        cuda = self._device().type == "cuda"
        self.decoder, why = choose_decoder(self.hparams.decode, cuda)
        self.decode_hardware_only = self.hparams.decode == AUTO  # auto: the JPEG engine, else the CPU decodes
        if problem := decoder_problem(self.decoder, why, cuda):
            raise ImageNetDataError(problem)

    @classmethod
    def plan_lines(cls, init_args: Any, cuda: bool) -> list[str]:
        """What the plan says of this data before anything is built: the decoder and where normalising runs, and the
        modern recipe's choices when they are on (augmentations and where they run, mixing, the sampler)."""
        if init_args.get("synthetic"):
            return ["data         synthetic uint8 images, normalised on the device", *recipe_lines(init_args)]
        decoder, why = choose_decoder(init_args.get("decode", AUTO), cuda)
        normalise = (
            "normalise    on the device, with the decoding (data.decode gpu)"
            if decoder == "gpu"
            else cls.normalise_line(init_args.get("normalize_on_device", AUTO), cuda)
        )
        return [decode_line(decoder, why, cuda), normalise, *recipe_lines(init_args, decoder)]

    def setup(self, stage: str | None = None) -> None:
        # here, not in __init__: the CLI wraps an __init__ error into its own long message
        self._resolve_decoder()
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
        files = not self.hparams.synthetic
        return {"collate_fn": collate} if files and (self.decoder == "gpu" or self.skip_unreadable) else {}

    def train_dataloader(self) -> DataLoader:
        if getattr(self, "train_set", None) is None:
            raise ImageNetDataError("setup('fit') was not run: no training set")
        return self._loader(self.train_set, train=True, drop_last=True, **self._collate())

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
