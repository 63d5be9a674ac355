"""Input pipeline per CPU core: ``python -m bench.loader`` (img/s of the ImageNet training transform, one core).

Generates ImageNet-like JPEGs (about 500x375, quality 90, ~100 KB, like the ILSVRC training set's median image) from
the real photos the tests use (``tests/unit/test_imagenet.py``), by random crops, scales and flips, then measures one
process with one thread reading, decoding and transforming each file exactly as the training loader does
(``datamodules.imagenet.classic_transforms``: RandomResizedCrop 224 + horizontal flip, then float + normalise, or
uint8 with ``--uint8`` as ``normalize_on_device`` does), with two decoders:

- ``pil``: ``PIL.Image.open(...).convert("RGB")`` (the decoder torchvision's ImageFolder uses);
- ``tensor``: TorchCodec's ``decode_jpeg`` (libjpeg-turbo) to a uint8 tensor, the transform then runs on tensors
  (until issue 24: the deprecated ``torchvision.io.decode_jpeg``).

The decoders alternate round by round (A B A B ...) so a change in machine load hits both alike; the result is the
median over rounds of img/s, and the cores needed to feed a given rate (``--target``, 3,000 img/s: one H200's
ResNet-50 bf16 target) are ``target / (img/s per core)``, ignoring collation and the main process.
Writes ``bench/results/loader.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from bench.common import RESULTS, machine, machine_line, write_json

DECODERS = ("pil", "tensor")


def photo_files() -> list[Path]:
    """The real photos: from ``$BENCH_PHOTOS`` (a folder; ``make gpu-wheels`` fills ``.gpu-wheels/photos`` for a
    machine without scikit-image, scikit-learn and matplotlib), else from those packages, as the tests take them."""
    if os.environ.get("BENCH_PHOTOS"):
        return sorted(p for p in Path(os.environ["BENCH_PHOTOS"]).iterdir() if p.is_file())
    from tests.unit.test_imagenet import _photo_sources

    return [p for files in _photo_sources().values() for p in files]


def export_photos(folder: str | Path) -> None:
    """Copies the real photos into ``folder`` (for ``$BENCH_PHOTOS``)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for path in photo_files():
        shutil.copyfile(path, Path(folder) / path.name)


def make_jpegs(folder: Path, count: int, size: tuple[int, int] = (500, 375), seed: int = 0) -> list[Path]:
    """``count`` JPEGs of ``size`` (landscape or portrait, at random), quality 90, cut from the real photos."""
    rng = random.Random(seed)
    photos = [Image.open(p).convert("RGB") for p in photo_files()]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        photo = rng.choice(photos)
        width, height = size if rng.random() < 0.75 else size[::-1]
        scale = max(1.0, width / photo.width, height / photo.height) * rng.uniform(1.0, 1.1)  # little upscaling
        resized = photo.resize((round(photo.width * scale), round(photo.height * scale)), Image.Resampling.BICUBIC)
        left, top = rng.randint(0, resized.width - width), rng.randint(0, resized.height - height)
        image = resized.crop((left, top, left + width, top + height))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        path = folder / f"{index:05d}.jpg"
        image.save(path, quality=90)
        paths.append(path)
    return paths


def load(path: Path, decoder: str) -> Any:
    """The image as the given decoder (``datamodules.decode``: ``pil``, or ``tensor`` = TorchCodec) hands it over."""
    from datamodules.decode import decode, read

    return decode(read(str(path)), "pil" if decoder == "pil" else "cpu")


def rate(paths: list[Path], decoder: str, transform: Any) -> float:
    """Images per second of read + decode + transform, one thread."""
    start = time.perf_counter()
    for path in paths:
        transform(load(path, decoder))
    return len(paths) / (time.perf_counter() - start)


def run(count: int, rounds: int, image_size: int, uint8: bool, target: float, folder: Path) -> dict[str, Any]:
    from datamodules.imagenet import classic_transforms

    torch.set_num_threads(1)  # one core: a DataLoader worker runs one thread too
    load_before = os.getloadavg()[0]
    paths = make_jpegs(folder, count)
    transform = classic_transforms(image_size, train=True, uint8=uint8)
    for decoder in DECODERS:  # warm-up: imports, caches
        rate(paths[: min(20, count)], decoder, transform)
    rates: dict[str, list[float]] = {d: [] for d in DECODERS}
    for _ in range(rounds):
        for decoder in DECODERS:
            torch.manual_seed(0)  # the same crops for both decoders
            rates[decoder].append(rate(paths, decoder, transform))
    sizes = [p.stat().st_size for p in paths]
    rows = []
    for decoder in DECODERS:
        median = statistics.median(rates[decoder])
        rows.append(
            {
                "decoder": decoder,
                "img_per_s_per_core": round(median, 1),
                "min": round(min(rates[decoder]), 1),
                "max": round(max(rates[decoder]), 1),
                "cores_for_target": round(target / median, 1),
            }
        )
    return {
        "machine": machine(),
        "settings": {
            "images": count,
            "rounds": rounds,
            "image_size": image_size,
            "output": "uint8" if uint8 else "float32 normalised",
            "jpeg": "about 500x375 (25% portrait), quality 90, cut from the test photos",
            "mean_kb": round(statistics.mean(sizes) / 1024, 1),
            "target": target,
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        },
        "rows": rows,
        "tensor_over_pil": round(rows[1]["img_per_s_per_core"] / rows[0]["img_per_s_per_core"], 2),
    }


def dataloader_rate(folder: Path, count: int, workers: int, batch_size: int, image_size: int = 224) -> dict[str, Any]:
    """img/s of the real training loader (``ImageNetDataModule``, ``workers`` processes) over ``count`` generated
    JPEGs in 10 class folders, after one warm-up batch (worker start-up excluded)."""
    from datamodules.imagenet import ImageNetDataModule

    for split, n in (("train", count), ("val", 10)):
        paths = make_jpegs(folder / "flat" / split, n, seed=len(split))
        for i, path in enumerate(paths):
            (folder / split / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
            path.rename(folder / split / f"class{i % 10}" / path.name)
    datamodule = ImageNetDataModule(str(folder), batch_size=batch_size, num_workers=workers, image_size=image_size)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    batches = iter(loader)
    next(batches)
    start, images = time.perf_counter(), 0
    for images_, _ in batches:
        images += len(images_)
    seconds = time.perf_counter() - start
    return {"workers": workers, "batch_size": batch_size, "images": images, "img_per_s": round(images / seconds, 1)}


def markdown(results: dict[str, Any], command: str) -> str:
    s = results["settings"]
    lines = [
        "# Input pipeline per CPU core (`bench.loader`)",
        "",
        f"Machine: {machine_line(results['machine'])}.",
        f"{s['images']} JPEGs ({s['jpeg']}, mean {s['mean_kb']} KB), training transform RandomResizedCrop "
        f"{s['image_size']} + flip, output {s['output']}; one process, one thread; median over {s['rounds']} "
        f"interleaved rounds. Load average (1 min) before / after: {s['load_average'][0]} / {s['load_average'][1]} "
        "(2 cores: above 1, other jobs shared the machine and the absolute figures are low; the ratio holds). "
        f"Command: `{command}`",
        "",
        f"| decoder | img/s per core, median (min-max) | cores for {s['target']:,.0f} img/s |",
        "|---|---|---|",
    ]
    for r in results["rows"]:
        rate_range = f"{r['img_per_s_per_core']} ({r['min']}-{r['max']})"
        lines.append(f"| {r['decoder']} | {rate_range} | {r['cores_for_target']} |")
    lines += ["", f"tensor / pil: {results['tensor_over_pil']}x"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.loader", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=500, help="JPEGs generated and decoded per round (500)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per decoder (7)")
    parser.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop size (224)")
    parser.add_argument("--uint8", action="store_true", help="uint8 output (data.normalize_on_device true)")
    parser.add_argument("--target", type=float, default=3000.0, help="img/s to feed (3000: one H200, ResNet-50)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for loader.{json,md} (bench/results)")
    parser.add_argument("--dataloader-workers", type=int, default=None, help="instead: the real training loader's "
                        "img/s with this many workers (writes loader_dataloader.json)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=256, help="with --dataloader-workers (256)")
    args = parser.parse_args(argv)
    if args.dataloader_workers is not None:
        with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
            result = dataloader_rate(Path(tmp), args.images, args.dataloader_workers, args.batch_size, args.image_size)
        result |= {"machine": machine(), "command": " ".join(["python -m bench.loader", *(argv or sys.argv[1:])])}
        write_json(args.out / "loader_dataloader.json", result)
        print(result)
        return result
    command = "python -m bench.loader " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        results = run(args.images, args.rounds, args.image_size, args.uint8, args.target, Path(tmp))
    results["command"] = command.strip()
    write_json(args.out / "loader.json", results)
    (args.out / "loader.md").write_text(markdown(results, results["command"]))
    print(markdown(results, results["command"]))
    return results


if __name__ == "__main__":
    main()
