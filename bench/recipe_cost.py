"""What the modern ImageNet recipe adds to a training step: ``python -m bench.recipe_cost``.

The recipe's extra work (``configs/imagenet_modern.yaml``) against the classic recipe's, piece by piece, in one
process, the two alternating round by round (a change in load hits both alike; the median over rounds is kept):

1. a loader worker (one thread, as each worker runs): read + decode (TorchCodec) + transform per training image,
   classic (RandomResizedCrop + flip) against modern (+ TrivialAugmentWide + random erasing 0.1), uint8 out (the CPU
   decoding path on CUDA normalises on the device); under GPU decoding a worker only reads and draws: the same two
   recipes' draws (header, crop box, flip; + TrivialAugment's operation and the erasing box);
2. GPU decoding's part in the training process (:class:`datamodules.gpu_decode.BatchDecoder`): one batch decoded,
   resized and normalised, classic against modern (TrivialAugment batched per operation on the device, the erasing
   in one write for the batch), synchronised;
3. the mixing of a batch (:class:`datamodules.augment.BatchMixer`: MixUp or CutMix) on the device;
4. the moving average's update of ResNet-50's weights and buffers (every 32 steps in the recipe: a step pays 1/32).

Per step of ``--batch`` images: the loader workers' CPU seconds (divide by the workers a process has), and the
training process's milliseconds on the device (2 + 3 + 4/32). On a machine without CUDA the device is the CPU
(nvImageCodec's CPU backend, the CPU's mixing and averaging): those are the CPU's figures, not a GPU's.
Writes ``bench/results/recipe_cost_<device>.{json,md}`` (``--out``); ``--smoke``: tiny sizes, a check of the script.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, machine, machine_line, write_json

# the recipe's settings that cost time per step, for benchmarks that run it at the classic recipe's sizes (the same
# resolution and batch: what differs is the work per image and per batch)
MODERN_ARGS = [
    "--data.trivial_augment", "true", "--data.random_erasing", "0.1", "--data.mixup_alpha", "0.2",
    "--data.cutmix_alpha", "1.0", "--data.repeated_augmentation", "4", "--model.label_smoothing", "0.1",
    "--model.norm_weight_decay", "0.0", "--ema.torchvision_decay", "0.99998", "--ema.update_every_n_steps", "32",
]  # fmt: skip
SIZES = {
    "cuda": {"batch": 256, "px": 224, "images": 256, "rounds": 5, "arch": "resnet50"},
    "cpu": {"batch": 32, "px": 224, "images": 128, "rounds": 7, "arch": "resnet50"},
    "smoke": {"batch": 4, "px": 32, "images": 8, "rounds": 2, "arch": "resnet18"},
}
EMA_EVERY = 32  # the recipe's update_every_n_steps
CPU_NOTE = " (the CPU: nvImageCodec's CPU backend; not a GPU figure)"


def median_pair(rounds: int, classic: Callable[[], float], modern: Callable[[], float]) -> tuple[float, float]:
    """Medians of ``rounds`` alternating measurements (seconds) of each."""
    pairs = [(classic(), modern()) for _ in range(rounds)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def worker_seconds(paths: list[Path], transform: Any, gpu_decode: bool) -> float:
    """Seconds per image of a worker's part: read + decode + transform, or (GPU decoding) read + draw."""
    from datamodules.decode import decode_for, read
    from datamodules.gpu_decode import draw
    from datamodules.resumable import _seed_all, sample_seed

    start = time.perf_counter()
    for index, path in enumerate(paths):
        _seed_all(sample_seed(0, 0, index))  # as SeededDataset seeds each sample: the same draws for both recipes
        data = read(str(path))
        if gpu_decode:
            draw(data, transform)
        else:
            image, rest = decode_for(data, transform, "cpu")
            rest(image)
    return (time.perf_counter() - start) / len(paths)


def decoder_seconds(paths: list[Path], transform: Any, device: torch.device, batch: int) -> tuple[Callable, Any]:
    """A function timing :class:`BatchDecoder` on one batch of ``paths`` drawn with ``transform``, synchronised."""
    from datamodules.decode import read
    from datamodules.gpu_decode import BatchDecoder, EncodedBatch, draw
    from datamodules.resumable import _seed_all, sample_seed

    samples = []
    for index, path in enumerate(paths[:batch]):
        _seed_all(sample_seed(0, 0, index))
        data = read(str(path))
        samples.append((data, draw(data, transform), index % 10, path.name))
    encoded = EncodedBatch(samples, [])
    if device.type == "cuda":
        encoded = encoded.pin_memory()
    decoder = BatchDecoder(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def run() -> float:
        _sync(device)
        start = time.perf_counter()
        decoder(encoded, dtype)
        _sync(device)
        return time.perf_counter() - start

    run()  # warm-up: the decoder's first batch
    return run, encoded


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mixing_seconds(device: torch.device, batch: int, px: int, rounds: int) -> float:
    """Median seconds of mixing one batch on ``device`` (bf16 on CUDA, as the recipe's step sees it)."""
    from datamodules.augment import BatchMixer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    images = torch.rand(batch, 3, px, px, device=device).to(dtype)
    labels = torch.randint(0, 1000, (batch,), device=device)
    mixer = BatchMixer(1000, mixup_alpha=0.2, cutmix_alpha=1.0, seed=0)
    times = []
    for step in range(rounds + 1):
        _sync(device)
        start = time.perf_counter()
        mixer(images, labels, epoch=0, batch=step)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def average_seconds(device: torch.device, arch: str, rounds: int) -> float:
    """Median seconds of one update of the moving average (weights and buffers) of ``arch`` on ``device``."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from modules.zoo import build

    net = build(arch, num_classes=1000, in_channels=3).to(device)
    average = AveragedModel(net, device=device, use_buffers=True, avg_fn=get_ema_avg_fn(0.999))
    times = []
    for _ in range(rounds + 1):
        _sync(device)
        start = time.perf_counter()
        average.update_parameters(net)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(z: dict[str, Any], device: torch.device, folder: Path) -> dict[str, Any]:
    from bench.loader import make_jpegs
    from datamodules.augment import image_transforms

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loader worker's one thread
    paths = make_jpegs(folder, int(z["images"]))
    px, batch, rounds = int(z["px"]), int(z["batch"]), int(z["rounds"])
    recipes = {
        "classic": image_transforms(px, True, uint8=True),
        "modern": image_transforms(px, True, uint8=True, trivial=True, erasing=0.1),
    }
    rows: dict[str, Any] = {}
    for name, gpu_decode in (
        ("worker: decode + transform (CPU decoding)", False),
        ("worker: draws (GPU decoding)", True),
    ):
        timers = [lambda r=recipe, g=gpu_decode: worker_seconds(paths, r, g) for recipe in recipes.values()]
        for timer in timers:
            timer()  # warm-up
        rows[name] = median_pair(rounds, *timers)
    torch.set_num_threads(threads)  # the training process's own threads
    classic, _ = decoder_seconds(paths, recipes["classic"], device, batch)
    modern, _ = decoder_seconds(paths, recipes["modern"], device, batch)
    rows["training process: GPU decoding of a batch"] = median_pair(rounds, classic, modern)
    rows["training process: mixing a batch"] = (0.0, mixing_seconds(device, batch, px, rounds))
    rows[f"training process: moving average update / {EMA_EVERY}"] = (
        0.0,
        average_seconds(device, z["arch"], rounds) / EMA_EVERY,
    )  # fmt: skip
    return {"rows": {k: {"classic_s": v[0], "modern_s": v[1]} for k, v in rows.items()}}


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    rows = results["rows"]
    per_image = "worker: decode + transform (CPU decoding)"
    draws = "worker: draws (GPU decoding)"
    device_rows = [k for k in rows if k.startswith("training process")]
    lines = [
        f"# The modern recipe's cost per step{' (SMOKE: tiny sizes, not a measurement)' if s['smoke'] else ''}",
        "",
        f"Machine: {machine_line(results['machine'])}. Command: `{s['command']}`. Device for the training process's "
        f"part: {s['device']}{CPU_NOTE if s['device'] == 'cpu' else ''}. "
        f"{s['px']} px, batch {s['batch']}, {s['images']} ImageNet-like JPEGs (about 500x375, q90), median of "
        f"{s['rounds']} alternating rounds.",
        "",
        "| part | classic | modern | modern / classic |",
        "|---|---|---|---|",
    ]
    for name in (per_image, draws):
        c, m = rows[name]["classic_s"], rows[name]["modern_s"]
        lines.append(f"| {name}, per image | {c * 1e3:.2f} ms | {m * 1e3:.2f} ms | {m / c:.2f}x |")
    for name in device_rows:
        c, m = rows[name]["classic_s"], rows[name]["modern_s"]
        ratio = f"{m / c:.2f}x" if c else "-"
        lines.append(f"| {name} | {c * 1e3:.2f} ms | {m * 1e3:.2f} ms | {ratio} |")
    batch = s["batch"]
    cpu_extra = (rows[per_image]["modern_s"] - rows[per_image]["classic_s"]) * batch
    device_extra = sum(rows[k]["modern_s"] - rows[k]["classic_s"] for k in device_rows)
    lines += [
        "",
        f"Per step of {batch} images: with CPU decoding the loader workers spend {cpu_extra * 1e3:.0f} ms more CPU "
        f"time (divided over the workers of a process); with GPU decoding the training process spends "
        f"{device_extra * 1e3:.1f} ms more on {s['device']} (the augmentations after decoding, the mixing, "
        f"1/{EMA_EVERY} of an average update).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check of this script")
    parser.add_argument("--out", type=Path, default=None, help="results folder (bench/results; smoke: runs/)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    z = dict(SIZES["smoke" if args.smoke else device.type])
    info = machine()
    command = "python -m bench.recipe_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="recipe-cost-") as tmp:
        results = {"machine": info, **run(z, device, Path(tmp))}
    results["settings"] = {**z, "smoke": args.smoke, "device": device.type, "command": command.strip()}
    name = re.sub(r"[^A-Za-z0-9]+", "-", (info.get("gpu") if cuda else None) or "cpu").strip("-")
    out = args.out or (Path("runs") / "bench-smoke" if args.smoke else RESULTS)
    stem = out / f"recipe_cost_{name}{'_smoke' if args.smoke else ''}"
    write_json(stem.with_suffix(".json"), results)
    stem.with_suffix(".md").write_text(markdown(results))
    print(f"{markdown(results)}wrote {stem}.json/.md")
    return results


if __name__ == "__main__":
    main()
