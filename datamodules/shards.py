"""ImageNet as a few hundred large shard files instead of 1.28 M small ones, for cluster filesystems.

On Lustre, GPFS or NFS every file opened is a metadata-server operation; an epoch over the ImageFolder opens every
image on every node. Converted, an epoch opens each shard once per loader worker (persistent workers: once per run)
and reads the images at known offsets. Convert once::

    python -m datamodules.shards convert --src IMAGENET_DIR --dst SHARDS_DIR [--max-side 512] [--workers K]

then train with ``--data.data_dir SHARDS_DIR`` (recognised by its ``manifest.json``).

Format (plain files, no new dependency): per split, ``shard-NNNNN.tar`` files in the WebDataset layout (members
``<class>/<stem>.<ext>`` with the image bytes and ``<class>/<stem>.cls`` with the label; ``tar tf`` lists them,
WebDataset reads them) in one seeded shuffled order, plus ``index.npy`` (shard, byte offset, size, label, position
in the source listing of every image) and ``keys.txt``. ``manifest.json`` (counts, classes, source, options,
checksums) is written last, atomically: a folder without it is an unfinished conversion and is never read.
litdata, the format the notes recommended, was not used: it imports boto3 at import time, whose botocore pins
python-dateutil<3, which conflicts with the tested set (python-dateutil 4.0.0); and its streaming reader brings the
traps the notes list (WindowShuffle on parallel filesystems, the stale restore flag), which a map-style reader over
offsets does not have. Written by hand for that reason: the reader is ~40 lines.

The reader is a map-style dataset in the source's ImageFolder order, so everything else stays as it is: the same
transforms and decoders, Lightning's ``DistributedSampler`` (a global shuffle every epoch), the app's unpadded
validation sampler (exact evaluation) and whatever resumes a map-style loader mid-epoch.

Parallel: ``--workers`` processes convert whole shards; across SLURM tasks (``srun``) each task takes every
``SLURM_NTASKS``-th shard (``--task-index`` / ``--num-tasks`` to set it by hand), and the last task to finish writes
the manifest. A rerun skips the shards already written and redoes the others.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import random
import resource
import sys
import tarfile
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from core.env import slurm_task
from core.errors import UsageError, UserError, report
from datamodules.base import available_cpus
from datamodules.decode import Decoder, _Skipped, decode
from datamodules.sources import SKIP_HINT, SampleDecoder

FORMAT, VERSION = "dptrain-shards", 1
MANIFEST, PLAN = "manifest.json", "plan.json"
SPLITS = ("train", "val")
SHARDS_FIX = f"Convert the shards again, or {SKIP_HINT}."
# index.npy columns
SHARD, OFFSET, SIZE, LABEL, SOURCE = range(5)


class ShardsError(UserError, RuntimeError):
    """The source, the output folder or a shards folder is not what the converter or the reader needs."""


@dataclass(frozen=True)
class Options:
    """What determines the content of a conversion (a rerun must give the same)."""

    max_side: int | None = None
    shard_images: int = 2000
    seed: int = 0
    quality: int = 90


def is_shards(folder: str | Path) -> bool:
    """Whether ``folder`` is a complete conversion (its manifest exists)."""
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / MANIFEST).read_text())


# ------------------------------------------------------------------------------------------------ converting
def list_source(src: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """Classes (sorted folder names, as ImageFolder) and each split's (path, label) list in ImageFolder's order."""
    if not src.is_dir():
        raise ShardsError(f"--src {src} does not exist: give the folder holding train/<class>/<image> and val/...")
    if not any(src.iterdir()):
        raise ShardsError(f"--src {src} is empty: give the folder holding train/<class>/<image> and val/...")
    samples: dict[str, list[tuple[str, int]]] = {}
    classes: list[str] = []
    for split in SPLITS:
        root = src / split
        if not root.is_dir():
            hint = (
                " (`python -m datamodules.imagenet_val --help` arranges the flat val folder)" if split == "val" else ""
            )
            raise ShardsError(f"--src {src} has no {split}/ folder: expected {split}/<class>/<image>{hint}")
        try:
            found, class_to_idx = find_classes(str(root))
            if split == "train":
                classes, mapping = found, class_to_idx
            elif found != classes:
                only = sorted(set(found) ^ set(classes))
                raise ShardsError(
                    f"train/ and val/ in {src} have different class folders (in one only: {only[:5]})",
                    help="different-class-folders",
                )
            samples[split] = make_dataset(str(root), mapping, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as err:  # no class folder, or a class folder without images
            said = str(err).rstrip(".")
            raise ShardsError(f"{root} is not a class layout: {said}; expected {split}/<class>/<image>") from err
    return classes, samples


def _plan(src: Path, options: Options) -> dict[str, Any]:
    classes, samples = list_source(src)
    splits = {}
    for split, items in samples.items():
        order = list(range(len(items)))
        random.Random(f"{options.seed}-{split}").shuffle(order)  # one seeded shuffled order
        shards = [order[i : i + options.shard_images] for i in range(0, len(order), options.shard_images)]
        splits[split] = {"images": len(items), "files": [os.path.relpath(p, src) for p, _ in items], "shards": shards}
        splits[split]["labels"] = [label for _, label in items]
    listing = hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": str(src.resolve()),
        "options": vars(options),
        "classes": classes,
        "listing_sha256": listing,
        "splits": splits,
    }


def _write_json(path: Path, data: Any) -> None:
    """Written to a temporary name then renamed: a killed process never leaves a half-written file under ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _prepare(src: Path, dst: Path, options: Options) -> dict[str, Any]:
    """The plan, created in ``dst`` or checked against the one there; refuses a folder holding something else."""
    plan = _plan(src, options)
    if dst.exists() and not dst.is_dir():
        raise ShardsError(f"--dst {dst} is a file: give a new or empty folder")
    if dst.is_dir() and any(dst.iterdir()) and not (dst / PLAN).is_file():
        raise ShardsError(
            f"--dst {dst} is not empty and holds no conversion ({PLAN} missing): give a new or empty folder, "
            "nothing is written into a folder of other files"
        )
    dst.mkdir(parents=True, exist_ok=True)
    if not (dst / PLAN).is_file():
        tmp = dst / f".{PLAN}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(plan))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, dst / PLAN)  # atomic and exclusive: of several SLURM tasks exactly one creates the plan
        tmp.unlink()
    there = json.loads((dst / PLAN).read_text())
    if (there["source"], there["options"]) != (plan["source"], plan["options"]):
        raise ShardsError(
            f"--dst {dst} holds a conversion of {there['source']} with options {there['options']}, not of {src} with "
            f"{plan['options']}: give another --dst, or delete that folder to start again"
        )
    if there["listing_sha256"] != plan["listing_sha256"]:
        raise ShardsError(
            f"the images in {src} changed since the conversion in {dst} began: delete {dst} and convert again"
        )
    return plan


def _encode(data: bytes, max_side: int | None, quality: int) -> tuple[bytes, str | None]:
    """The bytes to store and their new extension (None: the original bytes). Decodes every image once, so an
    unreadable one fails here (OSError, ValueError) and is skipped rather than found during training."""
    image = decode(data, "pil")
    if max_side is None or max(image.size) <= max_side:
        return data, None
    image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue(), ".jpg"


def _shard_path(dst: Path, split: str, number: int) -> Path:
    return dst / split / f"shard-{number:05d}.tar"


def _convert_shard(job: tuple[Path, Path, str, int, dict[str, Any], list]) -> tuple[str, int, int]:
    """Writes one shard (tar under a temporary name, renamed when complete) and its index, from its (position in
    the source listing, relative path, label) items; returns its split, images and unreadable images."""
    src, dst, split, number, options, spec = job
    path = _shard_path(dst, split, number)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rows, keys, skipped = [], [], []
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for source_index, relative, label in spec:
            try:
                data, extension = _encode((src / relative).read_bytes(), options["max_side"], options["quality"])
            except (OSError, ValueError, SyntaxError) as err:  # as the folder pipeline: listed and skipped
                skipped.append(f"{relative}: {type(err).__name__}: {err}")
                continue
            stem, suffix = os.path.splitext(Path(relative).relative_to(split).as_posix())
            key = stem
            member = tarfile.TarInfo(f"{key}{extension or suffix.lower()}")
            member.size, member.mtime = len(data), 0
            tar.addfile(member, io.BytesIO(data))
            cls = str(label).encode()
            label_member = tarfile.TarInfo(f"{key}.cls")
            label_member.size, label_member.mtime = len(cls), 0
            tar.addfile(label_member, io.BytesIO(cls))
            rows.append([number, 0, len(data), label, source_index])
            keys.append(relative)
    with tarfile.open(tmp) as tar:  # the data offsets, from the headers just written
        offsets = [m.offset_data for m in tar.getmembers() if not m.name.endswith(".cls")]
    for row, offset in zip(rows, offsets, strict=True):
        row[OFFSET] = offset
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, path)
    np.save(path.with_suffix(".npy"), np.asarray(rows, dtype=np.int64).reshape(-1, 5))
    meta = {"images": len(rows), "bytes": path.stat().st_size, "sha256": digest, "keys": keys, "skipped": skipped}
    _write_json(path.with_suffix(".json"), meta)  # last: the shard's "done" mark
    return split, len(spec), len(skipped)


def _done(dst: Path, split: str, number: int) -> bool:
    path = _shard_path(dst, split, number)
    meta = path.with_suffix(".json")
    if not (meta.is_file() and path.is_file() and path.with_suffix(".npy").is_file()):
        return False
    return json.loads(meta.read_text())["bytes"] == path.stat().st_size


def _finish(dst: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """Writes the indexes and the manifest once every shard is done; None while some are missing."""
    for split, spec in plan["splits"].items():
        if not all(_done(dst, split, n) for n in range(len(spec["shards"]))):
            return None
    splits = {}
    for split, spec in plan["splits"].items():
        shards, rows, keys, skipped = [], [], [], []
        for number in range(len(spec["shards"])):
            path = _shard_path(dst, split, number)
            meta = json.loads(path.with_suffix(".json").read_text())
            shards.append(
                {"file": path.name, "images": meta["images"], "bytes": meta["bytes"], "sha256": meta["sha256"]}
            )
            rows.append(np.load(path.with_suffix(".npy")))
            keys += meta["keys"]
            skipped += meta["skipped"]
        index = np.concatenate(rows)
        order = np.argsort(index[:, SOURCE], kind="stable")  # the reader's order: the source's (ImageFolder)
        # atomic, as every file here: two SLURM tasks finishing together both write these (the same bytes)
        tmp = dst / split / f".index.npy.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, index[order])
        os.replace(tmp, dst / split / "index.npy")
        tmp = dst / split / f".keys.txt.{os.getpid()}.tmp"
        tmp.write_text("".join(f"{keys[i]}\n" for i in order))
        os.replace(tmp, dst / split / "keys.txt")
        splits[split] = {"images": int(len(index)), "source_images": spec["images"], "skipped": skipped}
        splits[split]["shards"] = shards
    manifest = {k: plan[k] for k in ("format", "version", "source", "options", "classes")}
    manifest |= {"splits": splits, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json(dst / MANIFEST, manifest)
    return manifest


def convert(
    src: str | Path,
    dst: str | Path,
    options: Options = Options(),
    workers: int = 1,
    task_index: int = 0,
    num_tasks: int = 1,
    progress: bool = True,
) -> dict[str, Any] | None:
    """Converts ``src`` (train/ and val/ class folders) into shards in ``dst``; returns the manifest, or None when
    other tasks still have shards to write."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread in the parent of the forked workers

    src, dst = Path(src), Path(dst)
    if is_shards(dst):
        manifest = read_manifest(dst)
        if (manifest["source"], manifest["options"]) == (str(src.resolve()), vars(options)):
            return manifest  # already complete: a rerun is a no-op
    plan = _prepare(src, dst, options)
    jobs = []
    for split, spec in plan["splits"].items():
        (dst / split).mkdir(exist_ok=True)
        for number, order in enumerate(spec["shards"]):
            mine = number % num_tasks == task_index
            if mine and not _done(dst, split, number):
                for stale in (dst / split).glob(f".shard-{number:05d}.*"):  # left by a killed run: redone from scratch
                    stale.unlink()
                items = [(i, spec["files"][i], spec["labels"][i]) for i in order]  # only this shard's: pickled
                jobs.append((src, dst, split, number, vars(options), items))
    total = sum(len(job[5]) for job in jobs)
    skipped = 0
    with tqdm(total=total, unit="img", desc=f"converting {src}", disable=not progress, smoothing=0.1) as bar:
        if workers > 1 and len(jobs) > 1:
            # fork, as the DataLoader's workers: spawn would import torch again in every worker (seconds each)
            with get_context("fork").Pool(workers) as pool:
                for _, images, bad in pool.imap_unordered(_convert_shard, jobs):
                    bar.update(images)
                    skipped += bad
        else:
            for job in jobs:
                _, images, bad = _convert_shard(job)
                bar.update(images)
                skipped += bad
    return _finish(dst, plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datamodules.shards", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert an ImageFolder tree (train/, val/) into shards")
    conv.add_argument("--src", type=Path, required=True, help="folder with train/<class>/<image> and val/<class>/...")
    conv.add_argument("--dst", type=Path, required=True, help="new or empty folder for the shards")
    conv.add_argument("--max-side", type=int, help="re-encode images whose longer side exceeds N to N (JPEG)")
    conv.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (90)")
    conv.add_argument("--shard-images", type=int, default=2000, help="images per shard (2000: ~220 MB of ImageNet)")
    conv.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (0)")
    conv.add_argument("--workers", type=int, default=available_cpus(), help="processes (the CPUs this job may use)")
    # SLURM's own variables: srun starts one task per shard subset
    task, tasks = slurm_task()
    conv.add_argument("--task-index", type=int, default=task,
                      help="converts the shards whose number %% num-tasks is this ($SLURM_PROCID, 0)")  # fmt: skip
    conv.add_argument("--num-tasks", type=int, default=tasks,
                      help="tasks sharing the conversion ($SLURM_NTASKS, 1)")  # fmt: skip
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.max_side is not None and args.max_side < 8:
        report(UsageError(f"--max-side must be at least 8 pixels, got {args.max_side}"))
        return 2
    if args.shard_images < 1 or not 0 <= args.task_index < args.num_tasks:
        report(UsageError("--shard-images must be positive and 0 <= --task-index < --num-tasks"))
        return 2
    options = Options(max_side=args.max_side, shard_images=args.shard_images, seed=args.seed, quality=args.quality)
    try:
        manifest = convert(
            args.src, args.dst, options, args.workers, args.task_index, args.num_tasks, not args.no_progress
        )
    except (ShardsError, OSError) as err:
        report(err if isinstance(err, UserError) else UserError(str(err)))  # the CLI's one error channel
        return 1
    if manifest is None:
        print(
            f"task {args.task_index}/{args.num_tasks}: its shards are written; the last task to finish writes "
            f"{args.dst / MANIFEST} (or run the same command once more without --task-index/--num-tasks)"
        )
        return 0
    for split, info in manifest["splits"].items():
        print(
            f"{split}: {info['images']} images in {len(info['shards'])} shards "
            f"({sum(s['bytes'] for s in info['shards']) / 2**20:.1f} MiB), {len(info['skipped'])} unreadable skipped"
        )
        for line in info["skipped"]:
            print(f"  skipped {line}")
    print(f"complete: {args.dst / MANIFEST}")
    return 0


# ------------------------------------------------------------------------------------------------ reading
def _raise_open_files_limit(shards: int) -> None:
    """Lets a process keep every shard open (ImageNet: 666 at 2,000 images per shard), up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = shards + 256  # and the loader's own pipes, sockets and libraries
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard)
        )


class ShardDataset(Dataset):
    """One split of a converted folder as a map-style dataset, in the source's ImageFolder order.

    Each process (each loader worker) opens a shard file the first time it needs one and keeps it open; an image
    is one ``pread`` at its offset. ``files_opened`` counts the opens (``bench/loader.py`` reports it).

    Args:
        root: the converted folder (with ``manifest.json``).
        split: ``train`` or ``val``.
        transform: applied to the decoded image, as in the folder pipeline.
        decoder: see :mod:`datamodules.decode`; ``gpu`` returns the encoded bytes and the crop's draws.
        min_side: reduced-size decoding threshold (:func:`datamodules.decode.min_side_for`).
        skip_unreadable: return a skip marker instead of raising for an image that cannot be decoded.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        transform: Any,
        decoder: Decoder = "cpu",
        min_side: int | None = None,
        skip_unreadable: bool = False,
    ) -> None:
        self.root = Path(root)
        if not is_shards(self.root):
            raise ShardsError(f"{self.root} has no {MANIFEST}: an unfinished conversion; run the convert command again")
        manifest = read_manifest(self.root)
        if split not in manifest["splits"]:
            raise ShardsError(f"{self.root} holds no {split} split")
        self.classes: list[str] = manifest["classes"]
        self.files = [self.root / split / s["file"] for s in manifest["splits"][split]["shards"]]
        self.index = np.load(self.root / split / "index.npy")
        self.split = split
        self.sample = SampleDecoder(transform, decoder, min_side, skip_unreadable, fix=SHARDS_FIX)
        self.files_opened = 0
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        _raise_open_files_limit(len(self.files))

    def __len__(self) -> int:
        return len(self.index)

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked loader worker: its own descriptors, not the parent's
            self._fds, self._pid, self.files_opened = {}, os.getpid(), 0
            _raise_open_files_limit(len(self.files))
        if shard not in self._fds:
            try:
                self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
            except OSError as err:
                if err.errno != errno.EMFILE:
                    raise
                raise ShardsError(
                    f"too many open files: {len(self._fds)} shards of {self.root} are open in this process and the "
                    "limit is reached; raise it (ulimit -n) or convert with a larger --shard-images"
                ) from err
            self.files_opened += 1
        return self._fds[shard]

    def key(self, index: int) -> str:
        """The source file of sample ``index`` (read only for messages)."""
        return (self.root / self.split / "keys.txt").read_text().splitlines()[index]

    def __getitem__(self, index: int) -> tuple[Any, ...] | _Skipped:
        shard, offset, size, label, _ = (int(v) for v in self.index[index])
        data = os.pread(self._fd(shard), size, offset)
        where = functools.partial(self._where, shard, offset, index)
        return self.sample(lambda: data, label, f"{self.files[shard].name}@{offset}", where)

    def _where(self, shard: int, offset: int, index: int) -> str:
        return f"{self.files[shard]} at byte {offset} ({self.key(index)})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}  # descriptors do not travel to spawned workers

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
