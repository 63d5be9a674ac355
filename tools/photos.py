"""A tiny ImageNet of real photos, shared by the tests and the benchmarks: 9 photos in 6 classes, taken from the sample
data that scikit-image, scikit-learn and matplotlib ship (no download): ``make venv`` takes them out of those
packages' wheels into ``.venv/photos`` (``tools/gpu_carry.py photos``); ``$BENCH_PHOTOS`` names another folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from PIL import Image

from tools.gpu_carry import PHOTOS

CLASSES = {  # class -> the photos' file names
    "cat": ["chelsea.png"],
    "coffee_mug": ["coffee.png"],
    "rocket": ["rocket.jpg"],
    "motorcycle": ["motorcycle_left.png", "motorcycle_right.png"],
    "person": ["astronaut.png", "grace_hopper.jpg"],
    "scenery": ["china.jpg", "flower.jpg"],
}


def photo_sources() -> dict[str, list[Path]]:
    """class -> its photo files: in ``$BENCH_PHOTOS``, else ``.venv/photos``, else in the installed packages (an
    environment that has scikit-image, scikit-learn and matplotlib, such as ``make test-compat``'s)."""
    folder = Path(os.environ.get("BENCH_PHOTOS") or Path(sys.prefix) / "photos")
    if not folder.is_dir():
        import matplotlib
        import skimage
        import sklearn

        found = {Path(m).name: Path(pkg.__file__).parent.parent / m for pkg in (matplotlib, skimage, sklearn)
                 for m in PHOTOS if m.startswith(pkg.__name__)}  # fmt: skip
        return {cls: [found[name] for name in names] for cls, names in CLASSES.items()}
    missing = [name for names in CLASSES.values() for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks the photos {missing}: run `make venv` (or tools/gpu_carry.py photos)")
    return {cls: [folder / name for name in names] for cls, names in CLASSES.items()}


def build_photo_imagenet(root: Path, max_side: int = 192) -> Path:
    """``root/{train,val}/<class>/*.jpg`` from 9 real photos in 6 classes: val holds the 9 photos (an odd count),
    train each photo and its mirror image (18). Photos are shrunk to ``max_side`` so that decoding is cheap."""
    for cls, files in photo_sources().items():
        for split in ("train", "val"):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
        for f in files:
            image = Image.open(f).convert("RGB")
            image.thumbnail((max_side, max_side))
            image.save(root / "val" / cls / f"{f.stem}.jpg", quality=90)
            image.save(root / "train" / cls / f"{f.stem}.jpg", quality=90)
            image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(root / "train" / cls / f"{f.stem}_m.jpg")
    return root
