"""Arrange the official flat ImageNet validation folder into class folders, with symlinks (no image is copied).

The official ``ILSVRC2012_img_val.tar`` unpacks into one folder of 50,000 JPEGs; ImageFolder needs
``val/<wnid>/<image>``. Usage::

    python -m datamodules.imagenet_val IMAGES LABELS --out DATA_DIR/val [--devkit DEVKIT] [--train-dir DATA_DIR/train]

LABELS may be any of:

- ``LOC_val_solution.csv`` (Kaggle): ``ImageId,PredictionString`` with the wnid first in the prediction string;
- lines ``<image> <wnid>`` (space, tab or comma separated; the image with or without its extension);
- one label per line, for the images in sorted file-name order: wnids, or the integer ILSVRC2012_IDs of the
  official ``ILSVRC2012_validation_ground_truth.txt``, which need ``--devkit`` (the unpacked
  ``ILSVRC2012_devkit_t12`` folder, whose ``data/meta.mat`` maps IDs to wnids; read with scipy).

Every image must get exactly one label and every label an image; the links are relative, so the data folder can be
moved as a whole. Running it again is a no-op; a different existing file at a link's place is an error.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import Counter
from pathlib import Path

from core.errors import UserError, report

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png", ".webp", ".bmp"}


class ValLayoutError(ValueError):
    """The images, labels or output folder do not fit together; the message says how."""


def list_images(images: Path) -> list[Path]:
    if not images.is_dir():
        raise ValLayoutError(f"{images} is not a folder; give the folder the validation tar was unpacked into")
    found = sorted(p for p in images.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not found:
        raise ValLayoutError(f"{images} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return found


def _ilsvrc_id_to_wnid(devkit: Path) -> dict[int, str]:
    """ILSVRC2012_ID -> wnid from the devkit's ``data/meta.mat`` (torchvision parses it only inside a function)."""
    try:
        from scipy.io import loadmat
    except ImportError as err:
        raise ValLayoutError(f"reading the devkit's meta.mat needs scipy ({err}). Fix: pip install scipy") from err

    metafile = devkit / "data" / "meta.mat"
    if not metafile.is_file():
        raise ValLayoutError(f"{metafile} not found; --devkit is the unpacked ILSVRC2012_devkit_t12 folder")
    synsets = loadmat(str(metafile), squeeze_me=True)["synsets"]
    # fields: ILSVRC2012_ID, WNID, words, gloss, num_children, ...; the 1000 classes are the leaves
    return {int(s[0]): str(s[1]) for s in synsets if int(s[4]) == 0}


def read_labels(labels: Path, images: list[Path], devkit: Path | None = None) -> dict[Path, str]:
    """Maps each image to its wnid, whichever of the supported label formats ``labels`` is in."""
    text = labels.read_text().strip().splitlines()
    rows = [line.replace(",", " ").split() for line in text if line.strip()]
    by_stem = {p.stem: p for p in images}
    if rows and rows[0][:1] == ["ImageId"]:  # Kaggle LOC_val_solution.csv
        rows = [[r["ImageId"], r["PredictionString"].split()[0]] for r in csv.DictReader(text)]
    if rows and all(len(r) == 1 for r in rows):  # one label per image, in file-name order
        return _labels_in_file_order(labels, [r[0] for r in rows], images, devkit)
    mapping: dict[Path, str] = {}
    for row in rows:
        name, wnid = row[0], row[1] if len(row) > 1 else None
        image = by_stem.get(Path(name).stem)
        if wnid is None or image is None:
            raise ValLayoutError(
                f"{labels}: line {' '.join(row)!r} "
                + ("has no label" if wnid is None else "names no image in the folder")
            )
        if image in mapping and mapping[image] != wnid:
            raise ValLayoutError(f"{labels} gives {image.name} two labels: {mapping[image]} and {wnid}")
        mapping[image] = wnid
    unlabelled = [p.name for p in images if p not in mapping]
    if unlabelled:
        raise ValLayoutError(f"{len(unlabelled)} images have no label in {labels}, e.g. {', '.join(unlabelled[:3])}")
    return mapping


def _labels_in_file_order(labels: Path, values: list[str], images: list[Path], devkit: Path | None) -> dict[Path, str]:
    """One label (a wnid or an integer ILSVRC2012_ID) per line of ``labels``, for ``images`` in file-name order."""
    if len(values) != len(images):
        raise ValLayoutError(
            f"{labels} has {len(values)} labels (one per line) but {len(images)} images were found; "
            "one label per image, in sorted file-name order, is expected"
        )
    if all(v.isdigit() for v in values):
        if devkit is None:
            raise ValLayoutError(
                f"{labels} holds integer ILSVRC2012_IDs, which are not in wnid order: pass --devkit with the "
                "unpacked ILSVRC2012_devkit_t12 folder (its data/meta.mat maps IDs to wnids)"
            )
        to_wnid = _ilsvrc_id_to_wnid(devkit)
        unknown = sorted({int(v) for v in values} - set(to_wnid))
        if unknown:
            raise ValLayoutError(f"{labels}: ILSVRC2012_IDs {unknown[:5]} are not in {devkit}/data/meta.mat")
        values = [to_wnid[int(v)] for v in values]
    return dict(zip(images, values, strict=True))


def arrange(
    images: Path, labels: Path, out: Path, devkit: Path | None = None, train_dir: Path | None = None
) -> Counter:
    """Links every image of the flat folder ``images`` into ``out/<wnid>/``; returns the images per class."""
    files = list_images(images)
    mapping = read_labels(labels, files, devkit)
    if train_dir is not None:
        train_classes = {p.name for p in train_dir.iterdir() if p.is_dir()}
        missing = sorted(set(mapping.values()) - train_classes)
        if missing:
            raise ValLayoutError(
                f"{len(missing)} validation classes have no folder in {train_dir}, e.g. {', '.join(missing[:3])}: "
                "the labels do not belong to this training set"
            )
    for image, wnid in mapping.items():  # check everything first: no half-arranged folder on a conflict
        link = out / wnid / image.name
        if (link.exists() or link.is_symlink()) and link.resolve() != image.resolve():
            raise ValLayoutError(f"{link} exists and is not a link to {image}; remove it or choose another --out")
    for image, wnid in mapping.items():
        link = out / wnid / image.name
        if link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(image.resolve(), link.parent.resolve()))
    return Counter(mapping.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m datamodules.imagenet_val", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("images", type=Path, help="the flat folder of validation images (ILSVRC2012_img_val)")
    parser.add_argument("labels", type=Path, help="the ground-truth labels file (formats above)")
    parser.add_argument("--out", type=Path, required=True, help="the class-folder tree to create, e.g. DATA_DIR/val")
    parser.add_argument("--devkit", type=Path, help="unpacked ILSVRC2012_devkit_t12 (needed for integer IDs)")
    parser.add_argument("--train-dir", type=Path, help="DATA_DIR/train: check every class has a training folder")
    args = parser.parse_args(argv)
    try:
        counts = arrange(args.images, args.labels, args.out, args.devkit, args.train_dir)
    except (ValLayoutError, OSError) as err:
        report(UserError(f"imagenet_val: {err}", help="imagenet-val-layout"))  # the CLI's one error channel
        return 1
    total = sum(counts.values())
    print(f"linked {total} images into {len(counts)} class folders under {args.out} (symlinks, no copies)")
    if (total, len(counts)) != (50_000, 1000):
        print(f"note: the official ILSVRC-2012 validation set has 50000 images in 1000 classes, this has {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
