"""Pictures drawn from results files other benchmarks wrote: ``python -m bench.figures`` (no GPU, a second).

- ``first_screen.png`` (+ ``.md``, the same four figures as a table): the README's and the home page's picture,
  MNIST seconds of training to 99% test accuracy and ResNet-50 training images/s, on a CPU and on a GPU. From
  ``mnist_time_to_accuracy.json`` (CPU) and ``mnist_time_to_accuracy_gpu.json``, ``cpu_*.json`` (``python -m
  bench.gpu --cpu``) and ``gpu_*.json`` (``python -m bench.gpu`` on a GPU): the newest of each.
- ``gpu_throughput.png``: ResNet-50 images/s per precision and memory format of every ``gpu_*.json``.
- ``gpu_loader.png``: the training loader against the GPU it feeds, from ``gpu_check_B.jsonl`` (``make gpu-check
  CALL=B``).

Nothing is measured here: rerun the benchmark that wrote a file, then this.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from bench.common import RESULTS, figure

CPU_COLOUR, GPU_COLOUR = "#8c8c8c", "#3f51b5"


def newest(folder: Path, pattern: str) -> Path:
    """The newest results file matching ``pattern`` (the date is in the name), e.g. ``gpu_*_NVIDIA-*.json``."""
    found = sorted(p for p in folder.glob(pattern) if "_smoke" not in p.name)
    if not found:
        raise SystemExit(f"error: no {pattern} in {folder}: run the benchmark that writes it first")
    return found[-1]


def where(machine: dict[str, Any]) -> str:
    """A results file's machine in a few words: ``1x NVIDIA H200`` or ``2 CPU cores``."""
    return f"{machine['gpus']}x {machine['gpu']}" if machine.get("gpu") else f"{machine['host_cpus']} CPU cores"


def to_99(path: Path) -> tuple[str, float]:
    """The app's training seconds to 99% test accuracy in an ``mnist_time_to_accuracy`` file, and where."""
    results = json.loads(path.read_text())
    target = results["settings"]["target"]
    epoch = next(e for e in results["runs"]["app"]["epochs"] if e["test_acc"] >= target)
    return where(results["machine"]), epoch["train_wall_s"]


def fastest(path: Path) -> tuple[str, float, str]:
    """The fastest bf16 ResNet-50 configuration of a ``bench.gpu`` file (the one precision both a CPU and a GPU
    train in): where, images/s, which configuration."""
    results = json.loads(path.read_text())
    best = max((r for r in results["throughput"] if r["precision"] == "bf16-mixed"), key=lambda r: r["img_per_s"])
    return where(results["machine"]), best["img_per_s"], best["config"]


def rate(value: float) -> str:
    """Images/s as read: ``4,564``, or ``0.42`` for a CPU's."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}"


def first_screen(folder: Path) -> dict[str, Any]:
    files = {
        "mnist_cpu": folder / "mnist_time_to_accuracy.json",
        "mnist_gpu": folder / "mnist_time_to_accuracy_gpu.json",
        "resnet_cpu": newest(folder, "cpu_*.json"),
        "resnet_gpu": newest(folder, "gpu_*_NVIDIA-*.json"),
    }
    mnist = [to_99(files["mnist_cpu"]), to_99(files["mnist_gpu"])]
    resnet = [fastest(files["resnet_cpu"]), fastest(files["resnet_gpu"])]
    with figure(folder / "first_screen.png", nrows=2, figsize=(6.4, 3.9)) as (_, (left, right)):  # a phone reads rows
        bars = left.barh([m for m, _ in mnist], [s for _, s in mnist], color=[CPU_COLOUR, GPU_COLOUR])
        left.bar_label(bars, labels=[f"{s:.1f} s" for _, s in mnist], padding=3)
        left.set_title("MNIST: training seconds to 99% test accuracy", fontsize=10)
        left.set_xlim(0, max(s for _, s in mnist) * 1.3)
        bars = right.barh([m for m, _, _ in resnet], [v for _, v, _ in resnet], color=[CPU_COLOUR, GPU_COLOUR])
        right.bar_label(bars, labels=[f"{rate(v)} ({c})" for _, v, c in resnet], padding=3, fontsize=8)
        right.set_xscale("log")
        right.set_xlim(min(v for _, v, _ in resnet) / 2, max(v for _, v, _ in resnet) * 100)  # room for the label
        right.set_title("ResNet-50 training: images/s (log scale)", fontsize=10)
        for ax in (left, right):
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
    rows = [f"| MNIST, seconds of training to 99% test accuracy | {m} | {s:.1f} | `{files[k].name}` |"
            for (m, s), k in zip(mnist, ("mnist_cpu", "mnist_gpu"), strict=True)]  # fmt: skip
    rows += [f"| ResNet-50 training images/s ({c}) | {m} | {rate(v)} | `{files[k].name}` |"
             for (m, v, c), k in zip(resnet, ("resnet_cpu", "resnet_gpu"), strict=True)]  # fmt: skip
    text = [
        "# The first screen's picture: MNIST to 99% and ResNet-50 images/s, on a CPU and on a GPU",
        "",
        "Drawn by `python -m bench.figures` from the results files named in each row (the machine and the exact",
        "command are in each file).",
        "",
        "| figure | where | value | from |",
        "|---|---|---|---|",
        *rows,
    ]
    (folder / "first_screen.md").write_text("\n".join(text) + "\n")
    return {"mnist": mnist, "resnet": resnet}


def gpu_throughput(folder: Path) -> None:
    files = sorted(p for p in folder.glob("gpu_*_*.json") if "_smoke" not in p.name)
    runs = [json.loads(p.read_text()) for p in files]
    rows = [(where(r["machine"]), t["config"], t["img_per_s"]) for r in runs for t in r["throughput"]]
    with figure(folder / "gpu_throughput.png", figsize=(7.2, 0.32 * len(rows) + 1.2)) as (_, ax):
        labels = [f"{config} ({gpu})" if len(runs) > 1 else config for gpu, config, _ in rows]
        bars = ax.barh(labels, [v for _, _, v in rows], color=GPU_COLOUR)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for _, _, v in rows], padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(v for _, _, v in rows) * 1.15)
        ax.set_xlabel("images/s, one GPU, synthetic batch of 256 on the device")
        ax.set_title(f"ResNet-50 training throughput, {', '.join(sorted({g for g, _, _ in rows}))}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)


def gpu_loader(folder: Path) -> None:
    steps = [json.loads(line) for line in (folder / "gpu_check_B.jsonl").read_text().splitlines() if line.strip()]
    machine = next(s for s in steps if s["step"] == "call")["facts"][
        "machine"
    ]  # "...; 16 CPUs (x86_64), 1x NVIDIA H200; ..."
    gpu = found.group(1) if (found := re.search(r"\d+x ([^;]+);", machine)) else "the GPU"
    cpu = next(s["facts"] for s in steps if s["step"].startswith("training loader, 16 workers"))
    decode = next(s["facts"] for s in steps if s["step"].startswith("training loader, decode gpu"))
    bars = [
        ("loader: 16 workers, CPU decode", cpu["loader_img_per_s"], CPU_COLOUR),
        ("loader: 16 workers, GPU decode", decode["loader_img_per_s"], CPU_COLOUR),
        ("GPU trains ResNet-50 (bf16)", cpu["gpu_synthetic_img_per_s"], GPU_COLOUR),
    ]
    with figure(folder / "gpu_loader.png", figsize=(7.2, 2.0)) as (_, ax):
        drawn = ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
        ax.bar_label(drawn, labels=[f"{b[1]:,.0f}" for b in bars], padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(b[1] for b in bars) * 1.15)
        ax.set_xlabel("images/s")
        ax.set_title(f"Does the JPEG loader feed the GPU? One {gpu}, 16 CPU cores", fontsize=10)
        ax.grid(axis="x", alpha=0.3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder, read and written")
    args = parser.parse_args(argv)
    first_screen(args.results)
    gpu_throughput(args.results)
    gpu_loader(args.results)
    for name in ("first_screen.png", "first_screen.md", "gpu_throughput.png", "gpu_loader.png"):
        print(f"wrote {args.results / name}")


if __name__ == "__main__":
    main()
