"""A tiny ImageNet of real photos, shared by the tests and the benchmarks: 9 photos in 6 classes, taken from the sample
data that scikit-image, scikit-learn and matplotlib ship (no download)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def photo_sources() -> dict[str, list[Path]]:
    import matplotlib
    import skimage
    import sklearn

    sk = Path(skimage.__file__).parent / "data"
    sl = Path(sklearn.__file__).parent / "datasets" / "images"
    mpl = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data"
    return {
        "cat": [sk / "chelsea.png"],
        "coffee_mug": [sk / "coffee.png"],
        "rocket": [sk / "rocket.jpg"],
        "motorcycle": [sk / "motorcycle_left.png", sk / "motorcycle_right.png"],
        "person": [sk / "astronaut.png", mpl / "grace_hopper.jpg"],
        "scenery": [sl / "china.jpg", sl / "flower.jpg"],
    }


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
