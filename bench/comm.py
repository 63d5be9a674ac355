"""All-reduce bandwidth vs message size: ``python -m bench.comm`` (gloo on CPU; NCCL too when 2+ GPUs exist).

One ``torchrun`` job per backend; message sizes are interleaved round by round (A B C ... A B C ...) and each call is
timed alone (blocking, ``cuda.synchronize`` on GPUs) after warm-up calls; the time is the median over calls.
Bandwidths follow the nccl-tests convention: ``algbw = bytes / time`` and ``busbw = algbw * 2 (n - 1) / n``, the
traffic each link of a ring carries, comparable across world sizes.
Writes ``bench/results/comm_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import RESULTS, figure, machine_line, run_job, summary
from bench.common import report as report_results

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    """``4K`` / ``1M`` / ``64M`` / ``4096`` -> bytes (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    factor = units.get(text[-1:], 1)
    value = int(float(text[:-1] if text[-1:] in units else text) * factor)
    if value < 4 or value % 4:
        raise ValueError(f"message size {text!r}: give a multiple of 4 bytes (float32 elements), e.g. 4K or 64M")
    return value


def bus_factor(world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor ``2 (n - 1) / n``."""
    return 2 * (world - 1) / world


def worker(task: dict) -> dict[str, list[float]]:
    """Inside the torchrun job: seconds per all_reduce call, per message size (rank 0's timings)."""
    torch.set_num_threads(1)
    cuda = task.get("accelerator") == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    buffers = {size: torch.ones(size // 4, dtype=torch.float32, device=device) for size in task["sizes"]}
    times: dict[str, list[float]] = {str(size): [] for size in task["sizes"]}
    for round_index in range(task["warmup"] + task["rounds"]):
        for size, buffer in buffers.items():
            dist.barrier()
            for _ in range(task["iters"]):
                start = time.perf_counter()
                dist.all_reduce(buffer)
                if cuda:
                    torch.cuda.synchronize(device)
                if round_index >= task["warmup"]:
                    times[str(size)].append(time.perf_counter() - start)
                buffer.fill_(1.0)  # keep values finite (a sum doubles each call); outside the timed region
    return times


def analyse(raw: dict[str, list[float]], world: int) -> list[dict[str, Any]]:
    rows = []
    for size, seconds in raw.items():
        stats = summary(seconds)
        algbw = int(size) / (stats["median_ms"] / 1e3) / 1e9
        rows.append({"bytes": int(size), **stats, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(world)})
    return rows


def _human(size: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size / factor:g} {unit}"
    return f"{size} B"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"# all_reduce bandwidth, {s['backend']}, {s['world_size']} processes",
        "",
        f"Machine: {machine_line(results['machine'])}. Load average (1 min) before / after: "
        f"{results['load'][0]:.1f} / {results['load'][1]:.1f}.",
        f"float32 SUM; {s['rounds']} interleaved rounds x {s['iters']} calls per size after {s['warmup']} warm-up "
        f"round(s); median time per call. busbw = algbw x 2(n-1)/n = algbw x {bus_factor(s['world_size']):g}. "
        f"Command: `{s['command']}`",
        "",
        "| size | time us, median (p10-p90) | algbw GB/s | busbw GB/s |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {_human(row['bytes'])} | {row['median_ms'] * 1e3:.0f} ({row['p10_ms'] * 1e3:.0f}-"
            f"{row['p90_ms'] * 1e3:.0f}) | {row['algbw_GBps']:.3f} | {row['busbw_GBps']:.3f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    rows = results["rows"]
    with figure(path, figsize=(7, 4)) as (_, ax):
        sizes = [r["bytes"] for r in rows]
        if results["settings"]["world_size"] == 2:  # busbw = algbw x 2(n-1)/n is algbw: one line, not one hidden
            ax.plot(sizes, [r["algbw_GBps"] for r in rows], marker="o", label="algbw = busbw at 2 processes")
        else:
            ax.plot(sizes, [r["algbw_GBps"] for r in rows], marker="o", label="algbw")
            ax.plot(sizes, [r["busbw_GBps"] for r in rows], marker="s", label="busbw = algbw x 2(n-1)/n")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_human(s) for s in sizes], rotation=45, fontsize=7)
        ax.set_xlabel("message size")
        ax.set_ylabel("GB/s")
        s = results["settings"]
        ax.set_title(f"all_reduce, {s['backend']}, {s['world_size']} processes")
        ax.legend()


def report(raw: dict[str, list[float]], settings: dict[str, Any], load: list[float], out: Path) -> dict[str, Any]:
    """Statistics, table and plot of one backend's job; writes ``comm_<backend>.{json,md,png}`` into ``out``."""
    stem = out / f"comm_{settings['backend']}"
    figures = {"rows": analyse(raw, settings["world_size"])}
    return report_results(stem, settings, load, figures, markdown, lambda r: plot(r, stem.with_suffix(".png")))


def task(sizes: list[int], rounds: int, iters: int, warmup: int, accelerator: str = "cpu") -> dict[str, Any]:
    return {"name": "comm", "worker": "bench.comm:worker", "sizes": sizes, "rounds": rounds, "iters": iters,
            "warmup": warmup, "accelerator": accelerator}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds over all sizes (default 5)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per size per round (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--backends", default=None, help="gloo and/or nccl (default: gloo, plus nccl with 2+ GPUs)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError as err:
        parser.error(f"--sizes: {err}")
    if args.nproc < 2 or args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--nproc must be >= 2, --rounds and --iters >= 1, --warmup >= 0")
    gpus = torch.cuda.device_count()
    backends = args.backends.split(",") if args.backends else ["gloo"] + (["nccl"] if gpus >= args.nproc else [])
    if "nccl" in backends and gpus < args.nproc:
        parser.error(f"--backends nccl needs {args.nproc} GPUs (one per process), found {gpus}")
    command = "python -m bench.comm " + " ".join(argv if argv is not None else sys.argv[1:]).strip()
    out = []
    for backend in backends:
        load = [os.getloadavg()[0]]
        with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
            accelerator = "cuda" if backend == "nccl" else "cpu"
            raw = run_job([task(sizes, args.rounds, args.iters, args.warmup, accelerator)], args.nproc, Path(tmp))
        settings = {"backend": backend, "world_size": args.nproc, "rounds": args.rounds, "iters": args.iters,
                    "warmup": args.warmup, "command": command}  # fmt: skip
        results = report(raw["comm"], settings, [*load, os.getloadavg()[0]], args.out)
        print(markdown(results))
        out.append(results)
    return out


if __name__ == "__main__":
    main()
