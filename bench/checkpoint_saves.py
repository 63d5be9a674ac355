"""What a checkpoint save costs training, and what the node-local copy costs and saves: ``python -m
bench.checkpoint_saves`` (about a minute on 2 CPU cores).

For MNIST's default net and ResNet-50 (SGD with momentum: the weights and one state tensor per weight, as in
``last.ckpt``), the median of 5 of:

- the pause of a synchronous save (:class:`app.checkpoint.AtomicCheckpointIO`: write, SHA-256, fsync, rename), and
  of a save in the background (:class:`app.checkpoint.BackgroundSaves`: training waits only while the state is
  copied to host memory), with the background write's own duration, each as a share of the default 10-minute
  interval (``--checkpoint.interval_minutes``);
- the node-local copy (``--checkpoint.local_copy``), made by the background thread after the save: its duration in
  ``/dev/shm`` and in a folder of the disk;
- a restart's read of the checkpoint (``torch.load`` of the whole file, with the SHA-256 check a resume makes): from
  the run folder with its pages dropped from the page cache first (``posix_fadvise(DONTNEED)``: as a restart on
  another node, or after the cache was reclaimed, would read it), from the run folder while cached, and from the
  ``/dev/shm`` copy.

The run folder here is on this machine's local disk: on a cluster it is on a shared filesystem (NFS, Lustre, GPFS),
whose reads are what the node-local copy avoids; this script measures only this machine. Writes
``results/checkpoint_saves.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, machine, machine_line, save

REPEATS = 5
INTERVAL_S = 600.0


def state_of(arch: str) -> dict[str, Any]:
    """``last.ckpt``'s bulk for ``arch``: the weights and SGD's momentum after one step."""
    from modules.zoo import build

    shape = (1, 28, 28) if arch.startswith("mnist") else (3, 224, 224)
    model = build(arch, num_classes=10 if arch.startswith("mnist") else 1000, in_channels=shape[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, *shape)).sum().backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def median(timed) -> float:
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        timed()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def drop_cache(path: Path) -> None:
    """Drops ``path``'s pages from the page cache (clean pages only: it was fsynced), so the next read is the disk's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read(path: Path) -> None:
    """What a restart reads: the SHA-256 check of the resume's decision, then the whole checkpoint."""
    from app.checkpoint import Checkpoints

    assert Checkpoints().reader.intact(path)  # a new process's reader: nothing checked yet
    torch.load(path, map_location="cpu", weights_only=True)


def measure(arch: str, folder: Path) -> dict[str, Any]:
    from app.checkpoint import AtomicCheckpointIO, BackgroundSaves, LocalCopies, local_folder, remove_local_copies

    state = state_of(arch)
    run, disk_local = folder / arch / "run", folder / arch / "node-disk"
    path = run / "last.ckpt"
    sync = AtomicCheckpointIO()
    sync_s = median(lambda: sync.save_checkpoint(state, path))
    background, writes = BackgroundSaves(AtomicCheckpointIO()), []
    background.deferring = True

    def paused() -> None:
        background.save_checkpoint(state, path)

    pauses = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        paused()
        pauses.append(time.perf_counter() - t)
        background.wait()
        writes.append(time.perf_counter() - t)
    background.teardown()

    row: dict[str, Any] = {"arch": arch, "mb": path.stat().st_size / 1e6, "sync_s": sync_s}
    row["background_pause_s"], row["background_write_s"] = statistics.median(pauses), statistics.median(writes)
    for key in ("sync_s", "background_pause_s"):
        row[f"{key[:-2]}_share"] = row[key] / INTERVAL_S
    os.environ.pop("SLURM_TMPDIR", None)
    os.environ.pop("TMPDIR", None)  # /dev/shm
    shm = LocalCopies()  # the node's storage read now: /dev/shm
    row["local_shm_s"] = median(lambda: shm.copy(path))
    shm_copy = local_folder(path.parent) / path.name
    assert str(shm_copy).startswith("/dev/shm/")
    disk_local.mkdir(parents=True)
    os.environ["TMPDIR"] = str(disk_local)
    disk = LocalCopies()  # $TMPDIR
    row["local_disk_s"] = median(lambda: disk.copy(path))
    os.environ.pop("TMPDIR")

    def cold() -> None:
        drop_cache(path)
        read(path)

    row["read_cold_s"], row["read_cached_s"] = median(cold), median(lambda: read(path))
    row["read_shm_s"] = median(lambda: read(shm_copy))
    remove_local_copies(path.parent)
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# What a checkpoint save costs, and the node-local copy",
        "",
        f"`{result['command']}` on {machine_line(result['machine'])}; median of {REPEATS}. The run folder is on this "
        "machine's local disk (on a cluster: a shared filesystem, whose reads the node-local copy avoids).",
        "",
        "| network (SGD with momentum) | size | synchronous save | share of 10 min | background: pause | share of "
        "10 min | background write |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['arch']} | {r['mb']:.1f} MB | {r['sync_s']:.3f} s | {r['sync_share']:.3%} | "
            f"{r['background_pause_s']:.3f} s | {r['background_pause_share']:.3%} | {r['background_write_s']:.3f} s |"
        )
    lines += [
        "",
        "The node-local copy (made by the background thread after the save) and a restart's read (SHA-256 check and "
        "`torch.load` of the whole file):",
        "",
        "| network | copy to /dev/shm | copy to a disk folder | read, run folder, not cached | read, run folder, "
        "cached | read, /dev/shm copy |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['arch']} | {r['local_shm_s']:.3f} s | {r['local_disk_s']:.3f} s | {r['read_cold_s']:.3f} s | "
            f"{r['read_cached_s']:.3f} s | {r['read_shm_s']:.3f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="bench-saves-", dir=Path(__file__).resolve().parent.parent) as tmp:
        rows = [measure(arch, Path(tmp)) for arch in ("mnist_cnn", "resnet50")]
    save(args.out, "checkpoint_saves", {"command": "python -m bench.checkpoint_saves", "machine": machine(),
                                        "rows": rows}, markdown)  # fmt: skip


if __name__ == "__main__":
    main()
