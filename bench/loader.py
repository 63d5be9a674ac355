"""Input pipeline per CPU core: ``python -m bench.loader`` (img/s of the ImageNet training transform, one core).

Generates ImageNet-like JPEGs (about 500x375, quality 90, ~100 KB, like the ILSVRC training set's median image) from
the real photos the tests use (``tools/photos.py``), by random crops, scales and flips, then measures one
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

from bench.common import RESULTS, load_remark, machine, machine_line, write_json

DECODERS = ("pil", "tensor")


def photo_files() -> list[Path]:
    """The real photos, as the tests take them (``tools.photos``): from ``$BENCH_PHOTOS`` (a folder; ``make
    gpu-wheels`` fills ``.gpu-wheels/photos`` for the GPU machine; in name order), else ``.venv/photos``."""
    if os.environ.get("BENCH_PHOTOS"):
        return sorted(p for p in Path(os.environ["BENCH_PHOTOS"]).iterdir() if p.is_file())
    from tools.photos import photo_sources

    return [p for files in photo_sources().values() for p in files]


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


def dataloader_rate(
    folder: Path, count: int, workers: int, batch_size: int, batches: int, image_size: int = 224, decode: str = "cpu"
) -> dict[str, Any]:
    """img/s of the real training loader (``ImageNetDataModule``, ``workers`` processes) in its steady state.

    ``count`` JPEGs are generated, then hard-linked again and again into 10 class folders until an epoch holds
    ``batches`` batches: the same files (from the page cache after their first read), so the generation time does not
    grow with the length of the measurement. The clock starts once the batches that were already in flight when the
    workers started (``workers x prefetch_factor``) have been taken, so the rate is that of batches made while
    measured. With ``decode`` ``gpu`` the workers only read the files and draw the crops, and each batch is decoded,
    resized and normalised on the training device by nvImageCodec, as in training (its CPU backend without CUDA)."""
    from datamodules.imagenet import ImageNetDataModule

    train, val = make_jpegs(folder / "flat", count), make_jpegs(folder / "flat_val", 10, seed=1)
    for split, sources, total in (("train", train, batches * batch_size), ("val", val, len(val))):
        for i in range(total):
            target = folder / split / f"class{i % 10}"
            target.mkdir(parents=True, exist_ok=True)
            os.link(sources[i % len(sources)], target / f"{i:06d}.jpg")
    datamodule = ImageNetDataModule(
        str(folder), batch_size=batch_size, num_workers=workers, image_size=image_size, decode=decode
    )
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    in_flight = workers * (loader.prefetch_factor or 2) if workers else 1
    if batches < 2 * in_flight + 2:
        least = 2 * in_flight + 2
        sys.exit(f"error: --batches {batches} is too few to reach a steady state: at least {least} (twice the "
                 f"{in_flight} batches in flight at the start, workers x prefetch_factor, and 2)")  # fmt: skip
    stream = iter(loader)
    for _ in range(in_flight):
        datamodule.on_before_batch_transfer(next(stream), 0)
    start, images, measured = time.perf_counter(), 0, 0
    for batch in stream:  # decode gpu: decoded and transformed there; else as is
        images, measured = images + len(datamodule.on_before_batch_transfer(batch, 0)[0]), measured + 1
    if decode == "gpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "workers": workers, "batch_size": batch_size, "decode": decode, "unique_jpegs": count, "batches": batches,
        "skipped_in_flight": in_flight, "measured_batches": measured, "images": images,
        "img_per_s": round(images / seconds, 1),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ --breakdown
BREAKDOWN_PATHS = {  # the training paths of ImageNetDataModule, by what the workers hand over
    "cpu decode, float32 from the workers": {"decode": "cpu", "normalize_on_device": False},
    "cpu decode, uint8 from the workers": {"decode": "cpu", "normalize_on_device": True},
    "gpu decode (here: nvImageCodec's CPU backend)": {"decode": "gpu"},
}


def _nbytes(batch: Any) -> int:
    from datamodules.gpu_decode import EncodedBatch

    if isinstance(batch, EncodedBatch):
        return sum(t.nbytes for t in (batch.data, batch.offsets, batch.geometry, batch.labels))
    return sum(t.nbytes for t in batch if isinstance(t, torch.Tensor))


def breakdown(folder: Path, count: int, batch: int, rounds: int, image_size: int) -> dict[str, Any]:
    """Where a training batch's time goes on the CPU, per path: a loader worker's seconds for the batch (read,
    decode or draw, transform, collate; one thread, as a worker), the bytes that cross from the worker to the
    training process, and the training process's seconds for it (``on_before_batch_transfer`` and
    ``on_after_batch_transfer``: normalising, or decoding, resizing and normalising the batch). Interleaved rounds,
    medians. On a GPU the training process's part of the gpu path runs on the device instead."""
    from datamodules.imagenet import ImageNetDataModule

    torch.set_num_threads(1)
    for i, path in enumerate(make_jpegs(folder / "flat", count)):
        (folder / "train" / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
        (folder / "val" / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
        os.link(path, folder / "train" / f"class{i % 10}" / path.name)
        os.link(path, folder / "val" / f"class{i % 10}" / path.name)
    loaders = {}
    for name, options in BREAKDOWN_PATHS.items():
        dm = ImageNetDataModule(str(folder), batch_size=batch, num_workers=0, image_size=image_size, **options)
        dm.setup("fit")
        loaders[name] = (dm, dm.train_dataloader())
    times: dict[str, dict[str, list[float]]] = {n: {"worker": [], "main": []} for n in loaders}
    sizes: dict[str, int] = {}
    batches = [list(range(start, start + batch)) for start in range(0, count - batch + 1, batch)]
    for _ in range(rounds):
        for name, (dm, loader) in loaders.items():
            for indices in batches:
                began = time.perf_counter()
                collated = loader.collate_fn([loader.dataset[(i, 0)] for i in indices])  # what a worker does
                handed = time.perf_counter()
                dm.on_after_batch_transfer(dm.on_before_batch_transfer(collated, 0), 0)
                times[name]["worker"].append(handed - began)
                times[name]["main"].append(time.perf_counter() - handed)
                sizes[name] = _nbytes(collated)
    rows = []
    for name, measured in times.items():
        worker, main = statistics.median(measured["worker"]), statistics.median(measured["main"])
        rows.append(
            {"path": name, "worker_s_per_batch": round(worker, 4), "worker_img_per_s": round(batch / worker, 1),
             "kb_per_image_crossing": round(sizes[name] / batch / 1024, 1), "main_s_per_batch": round(main, 4),
             "main_img_per_s": round(batch / main, 1)}
        )  # fmt: skip
    return {"rows": rows, "batch": batch, "images": count, "rounds": rounds, "image_size": image_size}


def breakdown_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Where a training batch's time goes, per input path (`bench.loader --breakdown`)",
        "",
        f"Machine: {machine_line(result['machine'])}. Load average (1 min) before / after: "
        f"{result['load_average'][0]} / {result['load_average'][1]} ({load_remark(result['load_average'], 1)}). "
        f"Command: `{result['command']}`",
        f"{result['images']} ImageNet-like JPEGs (about 500x375, q90), batches of {result['batch']}, training "
        f"transform RandomResizedCrop {result['image_size']} + flip; medians over {result['rounds']} interleaved "
        "rounds. Worker: one thread, as a loader worker (read, decode or only draw the crop, collate). Crossing: "
        "what a worker hands the training process. Training process: its hooks before and after the transfer (CPU "
        "device; on a GPU the gpu path's decode, resize and normalising run on the device).",
        "",
        "| path | worker s/batch | worker img/s (one core) | KB per image crossing | training process s/batch "
        "| training process img/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        idle = r["main_s_per_batch"] < 0.001  # nothing left to do there (the workers normalised)
        main = "< 0.001 | -" if idle else f"{r['main_s_per_batch']} | {r['main_img_per_s']}"
        lines.append(
            f"| {r['path']} | {r['worker_s_per_batch']} | {r['worker_img_per_s']} | {r['kb_per_image_crossing']} | "
            f"{main} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ shards (--shards)
SOURCES = {"imagenet-like": (500, 375), "large": (1024, 768)}  # pixels of the generated JPEGs (25 % portrait)


def _class_tree(folder: Path, count: int, size: tuple[int, int]) -> Path:
    """``count`` JPEGs of ``size`` in 10 class folders under ``folder/train``, 20 under ``folder/val``."""
    for split, n in (("train", count), ("val", 20)):
        for i, path in enumerate(make_jpegs(folder / "flat" / split, n, size=size, seed=len(split))):
            (folder / split / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
            path.rename(folder / split / f"class{i % 10}" / path.name)
    return folder


def _dataset_rate(dataset: Any, order: list[int]) -> float:
    """img/s of ``dataset[i]`` (read + decode + training transform), one thread."""
    start = time.perf_counter()
    for index in order:
        dataset[index]
    return len(order) / (time.perf_counter() - start)


def _data_wait(data_dir: Path, steps: int) -> dict[str, float]:
    """Share of a short fit's training time spent waiting for the next batch (Lightning's SimpleProfiler), 1 worker,
    resnet18 at 64 px, batch 16: the slower the source, the larger the share."""
    import lightning.pytorch as pl

    from datamodules.imagenet import ImageNetDataModule
    from modules import ImageClassifier

    pl.seed_everything(0, verbose=False)
    dm = ImageNetDataModule(str(data_dir), batch_size=16, num_workers=1, image_size=64)
    model = ImageClassifier(arch="resnet18", num_classes=dm.num_classes, in_channels=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        profiler="simple",
    )
    trainer.fit(model, datamodule=dm)
    durations = trainer.profiler.recorded_durations
    wait = sum(sum(v) for k, v in durations.items() if k.endswith("train_dataloader_next"))
    total = sum(sum(v) for k, v in durations.items() if k.startswith("run_training_batch")) + wait
    return {"data_wait_s": round(wait, 2), "train_s": round(total, 2), "share": round(wait / total, 3)}


def shards_run(count: int, rounds: int, folder: Path, fit_steps: int) -> dict[str, Any]:
    """Folder vs shards, original vs ``--max-side 512``, each CPU decoder; conversion time; files opened; data wait."""
    from datamodules.imagenet import ImageNetDataModule
    from datamodules.shards import Options, convert

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows, conversions, waits = [], [], []
    for source, size in SOURCES.items():
        src = _class_tree(folder / source / "src", count, size)
        variants = {"folder": src}
        for name, max_side in (("shards", None), ("shards --max-side 512", 512)):
            dst = folder / source / name.replace(" ", "_")
            start = time.perf_counter()
            manifest = convert(src, dst, Options(max_side=max_side), workers=1, progress=False)
            seconds = time.perf_counter() - start
            images = sum(info["images"] for info in manifest["splits"].values())
            shards = sum(len(info["shards"]) for info in manifest["splits"].values())
            mb = sum(s["bytes"] for info in manifest["splits"].values() for s in info["shards"]) / 2**20
            conversions.append(
                {"source": source, "variant": name, "images": images, "shards": shards, "mib": round(mb, 1),
                 "s_per_1000_images": round(seconds / images * 1000, 1)}
            )  # fmt: skip
            variants[name] = dst
        rates: dict[tuple[str, str], list[float]] = {}
        opened: dict[str, int] = {}
        sets = {}
        for variant, data_dir in variants.items():
            for decoder in ("pil", "cpu"):
                dm = ImageNetDataModule(str(data_dir), batch_size=32, num_workers=0, decode=decoder)
                dm.setup("fit")
                sets[variant, decoder] = dm.train_set
        order = list(range(len(sets["folder", "cpu"])))
        random.Random(0).shuffle(order)
        for _ in range(rounds):  # interleaved: a change of machine load hits every variant alike
            for key, dataset in sets.items():
                torch.manual_seed(0)
                rates.setdefault(key, []).append(_dataset_rate(dataset, order))
        for variant in variants:
            files = getattr(sets[variant, "cpu"], "files_opened", None)
            opened[variant] = files if files is not None else len(order)  # the folder opens every image
        baseline = statistics.median(rates["folder", "cpu"])
        for (variant, decoder), values in rates.items():
            median = statistics.median(values)
            rows.append(
                {"source": source, "variant": variant, "decoder": "torchcodec" if decoder == "cpu" else "pil",
                 "img_per_s_per_core": round(median, 1), "min": round(min(values), 1), "max": round(max(values), 1),
                 "vs_folder_torchcodec": round(median / baseline, 2), "files_opened_per_epoch": opened[variant]}
            )  # fmt: skip
        if fit_steps:
            for variant, data_dir in variants.items():
                waits.append({"source": source, "variant": variant, **_data_wait(data_dir, fit_steps)})
    return {
        "machine": machine(),
        "settings": {
            "images": count,
            "rounds": rounds,
            "sources": {
                k: f"{w}x{h} (25% portrait), quality 90, cut from the test photos" for k, (w, h) in SOURCES.items()
            },
            "transform": "RandomResizedCrop 224 + flip, float32 normalised",
            "shard_images": Options().shard_images,
            "fit_steps": fit_steps,
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        },  # fmt: skip
        "rows": rows,
        "conversion": conversions,
        "data_wait": waits,
    }


def shards_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        "# Input pipeline: folder vs shards (`bench.loader --shards`)",
        "",
        f"Machine: {machine_line(results['machine'])}. Load average (1 min) before / after: "
        f"{s['load_average'][0]} / {s['load_average'][1]} on {results['machine']['host_cpus']} cores "
        f"({load_remark(s['load_average'], 1)}).",
        f"{s['images']} training JPEGs per source ({'; '.join(f'{k}: {v}' for k, v in s['sources'].items())}), "
        f"{s['transform']}; one process, one thread; median over {s['rounds']} interleaved rounds. "
        f"Command: `{results['command']}`",
        "",
        "| source | data | decoder | img/s per core, median (min-max) | vs folder + torchcodec | files opened/epoch |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['source']} | {r['variant']} | {r['decoder']} | {r['img_per_s_per_core']} ({r['min']}-{r['max']}) "
            f"| {r['vs_folder_torchcodec']}x | {r['files_opened_per_epoch']} |"
        )
    lines += ["", "Conversion (one process, `--workers 1`; it scales with `--workers` and SLURM tasks):", ""]
    lines += ["| source | output | images | shards | MiB | s per 1,000 images |", "|---|---|---|---|---|---|"]
    for c in results["conversion"]:
        lines.append(
            f"| {c['source']} | {c['variant']} | {c['images']} | {c['shards']} | {c['mib']} "
            f"| {c['s_per_1000_images']} |"
        )
    if results["data_wait"]:
        lines += ["", f"Data-wait share of a {s['fit_steps']}-step fit (resnet18, 64 px, batch 16, 1 loader worker, "]
        lines[-1] += "CPU; Lightning's SimpleProfiler, `train_dataloader_next` / training time):"
        lines += ["", "| source | data | waiting for data (s) | training (s) | share |", "|---|---|---|---|---|"]
        for w in results["data_wait"]:
            lines.append(f"| {w['source']} | {w['variant']} | {w['data_wait_s']} | {w['train_s']} | {w['share']:.1%} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any], command: str) -> str:
    s = results["settings"]
    lines = [
        "# Input pipeline per CPU core (`bench.loader`)",
        "",
        f"Machine: {machine_line(results['machine'])}.",
        f"{s['images']} JPEGs ({s['jpeg']}, mean {s['mean_kb']} KB), training transform RandomResizedCrop "
        f"{s['image_size']} + flip, output {s['output']}; one process, one thread; median over {s['rounds']} "
        f"interleaved rounds. Load average (1 min) before / after: {s['load_average'][0]} / {s['load_average'][1]} "
        f"({load_remark(s['load_average'], 1)}). "
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
    parser.add_argument("--batches", type=int, default=120, help="with --dataloader-workers: batches in the epoch, "
                        "the first workers x prefetch_factor not measured (120)")  # fmt: skip
    parser.add_argument(
        "--shards",
        action="store_true",
        help="instead: folder vs shards, original vs --max-side "
        "512, each decoder, conversion time, files opened, data wait (writes loader_shards.*)",
    )
    parser.add_argument("--fit-steps", type=int, default=20, help="with --shards: steps of the data-wait fit (20)")
    parser.add_argument("--decode", choices=("auto", "cpu", "pil", "gpu"), default="cpu",
                        help="with --dataloader-workers: data.decode (gpu: loader_dataloader_gpu.json)")  # fmt: skip
    parser.add_argument("--breakdown", action="store_true", help="instead: where a batch's time goes per input "
                        "path, worker / crossing / training process (writes loader_breakdown.*)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.breakdown:
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="bench-breakdown-") as tmp:
            result = breakdown(Path(tmp), args.images, min(args.batch_size, args.images), args.rounds, args.image_size)
        result |= {
            "machine": machine(),
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            "command": " ".join(["python -m bench.loader", *(argv if argv is not None else sys.argv[1:])]),
        }
        write_json(args.out / "loader_breakdown.json", result)
        (args.out / "loader_breakdown.md").write_text(breakdown_markdown(result))
        print(breakdown_markdown(result))
        return result
    if args.shards:
        with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
            result = shards_run(args.images, args.rounds, Path(tmp), args.fit_steps)
        result["command"] = " ".join(["python -m bench.loader", *(argv if argv is not None else sys.argv[1:])])
        write_json(args.out / "loader_shards.json", result)
        (args.out / "loader_shards.md").write_text(shards_markdown(result))
        print(shards_markdown(result))
        return result
    if args.dataloader_workers is not None:
        with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
            result = dataloader_rate(
                Path(tmp),
                args.images,
                args.dataloader_workers,
                args.batch_size,
                args.batches,
                args.image_size,
                args.decode,
            )
        result |= {"machine": machine(), "command": " ".join(["python -m bench.loader", *(argv or sys.argv[1:])])}
        name = "loader_dataloader_gpu.json" if args.decode == "gpu" else "loader_dataloader.json"
        write_json(args.out / name, result)
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
