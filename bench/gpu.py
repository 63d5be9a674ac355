"""One-GPU benchmark: ``python -m bench.gpu`` (under 8 minutes on one H200; ``--smoke``: a CPU check in < 60 s;
``--cpu``: the same measurement on the CPU, the figure beside a GPU's, into ``cpu_<date>_<N>cpus.{json,md}``).

ResNet-50 training throughput (images/s) on synthetic data through the app's own ``ImageClassifier`` and Lightning
``Trainer`` (single device, the precision plugins users select), for fp32 (TF32 off), TF32, bf16-mixed and
fp16-mixed, each with and without channels_last, and with ``torch.compile`` (channels_last; ``--compile-all``: every
variant). The batch is generated once on the GPU and fed every step, so the input pipeline is not measured (the
convention of the published synthetic-data figures). Throughput = measured steps x batch / wall time between a
synchronised start after ``--warmup`` steps and a synchronised end.

MFU = images/s x FLOP per image / peak FLOP/s. FLOP per image: 24.7 GFLOP, the issue's figure for ResNet-50 at
224 px, which is forward AND backward (forward is ~4.1 GMAC = 8.2 GFLOP; backward ~2x forward), scaled by
(size / 224)^2 for other sizes. Peak (dense, no sparsity) per precision from the GPU's datasheet: see ``PEAKS``.

Then MNIST time to 99% with the GPU accelerator, by running ``bench/mnist_time_to_accuracy.py`` (when present) as a
subprocess. Writes ``bench/results/gpu_<date>_<gpu-name>.{json,md}``. Needs no W&B.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, ROOT, batch_clock, machine, machine_line, write_json

FLOP_PER_IMAGE_224 = 24.7e9  # ResNet-50, forward + backward, per image at 224 x 224
# dense peak FLOP/s per precision (NVIDIA datasheets, SXM; TF32/bf16/fp16 tensor cores without sparsity)
PEAKS = {
    "H200": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12},
    "H100": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
}
# (name, Lightning precision, TF32 allowed, channels_last, torch.compile); the most important first: a run that
# reaches its --budget-s skips the rest and says so
CONFIGS = [
    ("bf16 channels_last", "bf16-mixed", True, True, False),
    ("fp16 channels_last", "16-mixed", True, True, False),
    ("tf32 channels_last", "32-true", True, True, False),
    ("bf16", "bf16-mixed", True, False, False),
    ("fp16", "16-mixed", True, False, False),
    ("tf32", "32-true", True, False, False),
    ("fp32 (TF32 off)", "32-true", False, False, False),
    ("fp32 (TF32 off) channels_last", "32-true", False, True, False),
    # compiled last: each compiles for a minute or more, and used up the budget before the baselines ran
    ("bf16 channels_last compiled", "bf16-mixed", True, True, True),
    ("fp16 channels_last compiled", "16-mixed", True, True, True),
    ("tf32 channels_last compiled", "32-true", True, True, True),
    ("bf16 compiled", "bf16-mixed", True, False, True),
    ("fp16 compiled", "16-mixed", True, False, True),
    ("tf32 compiled", "32-true", True, False, True),
]

SMOKE_CONFIGS = ("bf16 channels_last", "tf32")  # both memory formats, mixed and 32-bit precision
CPU_CONFIGS = ("fp32 (TF32 off)", "bf16")  # what a CPU computes: no TF32, no fp16 autocast training


def _peak_key(precision: str, tf32: bool) -> str:
    return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, "tf32" if tf32 else "fp32")


def peak_flops(gpu_name: str | None, precision: str, tf32: bool) -> float | None:
    """The dense peak for this GPU and precision, or None when the GPU is not in ``PEAKS`` (MFU then stays null)."""
    for key, peaks in PEAKS.items():
        if gpu_name and key in gpu_name:
            return peaks[_peak_key(precision, tf32)]
    return None


def flop_per_image(arch: str, image_size: int) -> float | None:
    """Training FLOP (forward + backward) per image: known for ResNet-50 only, scaled with the pixel count."""
    return FLOP_PER_IMAGE_224 * (image_size / 224) ** 2 if arch == "resnet50" else None


def mfu(img_per_s: float, arch: str, image_size: int, peak: float | None) -> float | None:
    """Model FLOP utilisation: achieved training FLOP/s over the precision's dense peak (None when unknown)."""
    flop = flop_per_image(arch, image_size)
    return img_per_s * flop / peak if flop and peak else None


class RepeatBatch:
    """The same on-device batch, ``steps`` times: no input pipeline in the measurement."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return (self.batch for _ in range(self.steps))


def _set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled  # convolutions: cuDNN's flag (on by default in PyTorch)


def measure(config: tuple, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Trains ``args.arch`` for warmup + steps batches in one configuration; returns images/s and MFU."""
    from lightning.pytorch import Trainer

    from modules import ImageClassifier

    name, precision, tf32, channels_last, compile_ = config
    _set_tf32(tf32)
    torch.manual_seed(0)
    model = ImageClassifier(
        arch=args.arch, num_classes=1000, in_channels=3, channels_last=channels_last, compile=compile_,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-5),
    )  # fmt: skip
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    batch = (torch.randn(shape, device=device), torch.randint(0, 1000, (args.batch_size,), device=device))
    # synchronised readings at the start of step ``warmup`` and at the end of the last step
    window = batch_clock(device, lambda i: i == args.warmup, lambda i: i == args.warmup + args.steps - 1)
    # benchmark=True: cuDNN autotunes each convolution shape once, as the ImageNet reference scripts do
    trainer = Trainer(
        accelerator=device, devices=1, precision=precision, max_epochs=1, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[window], default_root_dir=args.workdir, benchmark=True,
    )  # fmt: skip
    began = time.perf_counter()
    trainer.fit(model, train_dataloaders=RepeatBatch(batch, args.warmup + args.steps))
    seconds = window.ends[-1] - window.starts[0]
    # a non-finite loss would make fp16's GradScaler skip optimizer steps and flatter the throughput: record it
    loss = trainer.callback_metrics.get("train/loss")
    loss = float(loss) if loss is not None else None
    img_s = args.steps * args.batch_size / seconds
    peak = peak_flops(torch.cuda.get_device_name(0) if device == "cuda" else None, precision, tf32)
    del model, trainer, batch
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": name, "precision": precision, "tf32": tf32, "channels_last": channels_last, "compile": compile_,
        "img_per_s": img_s, "step_ms": seconds / args.steps * 1e3, "wall_s": time.perf_counter() - began,
        "peak_flops": peak, "mfu": mfu(img_s, args.arch, args.image_size, peak), "last_loss": loss,
        "loss_finite": loss is not None and math.isfinite(loss),
    }  # fmt: skip


def measure_plain(config: tuple, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The same network, batch, optimizer and precision as a plain PyTorch loop (no Lightning): its step time."""
    from modules import zoo

    name, precision, tf32, channels_last, _ = config
    _set_tf32(tf32)
    torch.manual_seed(0)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    net = zoo.build(args.arch, num_classes=1000, in_channels=3).to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device, enabled=precision == "16-mixed")
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    x = torch.randn(shape, device=device).contiguous(memory_format=memory_format)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        with torch.autocast(device, dtype=half or torch.float32, enabled=half is not None):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - start
    del net, optimizer, x, y
    return {"config": name, "step_ms": seconds / args.steps * 1e3}


def mnist_time_to_accuracy(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Runs ``python -m bench.mnist_time_to_accuracy --accelerator DEVICE`` (owned by the MNIST benchmark) and keeps
    the JSON it writes into a scratch ``--out`` folder, or its output tail when it wrote none."""
    script = ROOT / "bench" / "mnist_time_to_accuracy.py"
    if not script.exists():
        return {"skipped": f"{script.relative_to(ROOT)} not found"}
    with tempfile.TemporaryDirectory(prefix="bench-mnist-") as tmp:
        # the app's default config only (the PyTorch example's recipe is the CPU comparison): keeps under 8 minutes
        command = [sys.executable, "-m", "bench.mnist_time_to_accuracy", "--accelerator", device, "--only", "app"]
        command += ["--out", tmp]
        try:
            job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.mnist_timeout)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(command[1:]), "error": f"did not finish in {args.mnist_timeout} s"}
        found = {p.name: json.loads(p.read_text()) for p in Path(tmp).glob("*.json")}
    result: dict[str, Any] = {"command": " ".join(command[1:-2]), "exit": job.returncode, "results": found}
    if job.returncode != 0 or not found:
        result["output_tail"] = (job.stdout + job.stderr)[-3000:]
    return result


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    flop = f"{s['flop_per_image']:.3g}" if s["flop_per_image"] else "unknown"
    lines = [
        f"# {'CPU' if s.get('cpu') else 'GPU'} benchmark: {s['arch']} training throughput"
        f"{' (SMOKE: CPU, tiny sizes)' if s['smoke'] else ''}",
        "",
        f"Machine: {machine_line(results['machine'])}. Load average (1 min) before/after: "
        f"{' / '.join(f'{x:.1f}' for x in s.get('load', [])) or 'not recorded'}.",
        f"Synthetic on-device batch {s['batch_size']} x 3 x {s['image_size']}^2, {s['steps']} timed steps after "
        f"{s['warmup']} warm-up steps, single device through the app's Trainer. MFU: {flop} FLOP per image "
        f"(forward + backward) / dense peak of the precision. Command: `{s['command']}`",
        "",
        "| config | img/s | step ms | MFU | peak used (TFLOP/s) | last loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["throughput"]:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        peak = f"{r['peak_flops'] / 1e12:g}" if r["peak_flops"] else "-"
        loss = f"{r['last_loss']:.3f}" if r["loss_finite"] else f"{r['last_loss']} (NOT FINITE: steps may be skipped)"
        rate = f"{r['img_per_s']:.0f}" if r["img_per_s"] >= 100 else f"{r['img_per_s']:.2f}"  # a CPU's: 0.42
        lines.append(f"| {r['config']} | {rate} | {r['step_ms']:.1f} | {mfu} | {peak} | {loss} |")
    for skipped in results["skipped"]:
        lines.append(f"| {skipped} | skipped: --budget-s reached | | | | |")
    if results.get("plain"):
        p = results["plain"]
        lines += ["", f"App step / plain PyTorch loop step ({p['config']}, same process, same batch): "
                  f"{p['app_over_plain']:.3f}x (plain {p['step_ms']:.1f} ms)."]  # fmt: skip
    lines += ["", f"MNIST time to 99%: `{json.dumps(results['mnist'])[:1500]}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, 3 configs: a code check")
    parser.add_argument("--cpu", action="store_true", help="on the CPU at full size (fp32, bf16)")
    parser.add_argument("--arch", default="resnet50", help="zoo architecture (default resnet50)")
    parser.add_argument("--batch-size", type=int, default=256, help="images per step (default 256)")
    parser.add_argument("--image-size", type=int, default=224, help="px (default 224)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per config (default 30)")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps first (default 15)")
    parser.add_argument("--configs", default=None, help="comma-separated config names to run (default: all)")
    parser.add_argument("--compile-all", action="store_true", help="also compile the NCHW variants")
    parser.add_argument("--budget-s", type=float, default=250, help="skip the remaining configs after this (s)")
    parser.add_argument("--skip-mnist", action="store_true", help="leave out MNIST time to 99%%")
    parser.add_argument("--mnist-timeout", type=float, default=180, help="s allowed to the MNIST run")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results; smoke: runs/)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not (args.smoke or args.cpu):
        parser.error("no CUDA device here: run it on a GPU machine, or check the code path with --smoke (CPU)")
    if args.smoke:
        args.batch_size, args.image_size, args.steps, args.warmup = 2, 16, 1, 1
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the clock starts on a warmed-up step)")
    out = args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else RESULTS)
    device = "cuda" if cuda and not (args.smoke or args.cpu) else "cpu"
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|TF32|LeafSpec).*")
    configs = [c for c in CONFIGS if args.compile_all or not c[4] or c[3]]
    if args.smoke or args.cpu:  # CPU: no fp16 autocast training, no compile (needs a C++ toolchain and minutes)
        configs = [c for c in configs if c[0] in (SMOKE_CONFIGS if args.smoke else CPU_CONFIGS)]
    if args.configs:
        names = args.configs.split(",")
        unknown = [n for n in names if n not in {c[0] for c in CONFIGS}]
        if unknown:
            parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(c[0] for c in CONFIGS)}")
        configs = [c for c in CONFIGS if c[0] in names]
    info = machine()
    command = "python -m bench.gpu " + " ".join(argv if argv is not None else sys.argv[1:]).strip()
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", info["gpu"] or "cpu").strip("-")
    stem = out / f"gpu_{info['date'][:10]}_{gpu}{'_smoke' if args.smoke else ''}"
    if args.cpu:
        stem = out / f"cpu_{info['date'][:10]}_{info['host_cpus']}cpus"
    results = {
        "machine": info,
        "settings": {
            "arch": args.arch,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "smoke": args.smoke,
            "cpu": args.cpu,
            "load": [os.getloadavg()[0]],
            "device": device,
            "flop_per_image": flop_per_image(args.arch, args.image_size),
            "command": command,
        },
        "throughput": [],
        "plain": None,
        "skipped": [],
        "mnist": {"skipped": "--skip-mnist / --smoke / --cpu"}
        if args.skip_mnist or args.smoke or args.cpu
        else {"not": "run yet"},
    }

    def write() -> None:  # after each configuration: a run cut short keeps the finished ones
        write_json(stem.with_suffix(".json"), results)
        stem.with_suffix(".md").write_text(markdown(results) + "\n")

    began, rows = time.perf_counter(), results["throughput"]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        args.workdir = tmp
        for config in configs:
            if time.perf_counter() - began > args.budget_s:
                results["skipped"].append(config[0])
                continue
            rows.append(measure(config, args, device))
            print(f"{rows[-1]['config']:<32} {rows[-1]['img_per_s']:8.0f} img/s", flush=True)
            if results["plain"] is None:  # the first configuration again as a plain PyTorch loop, in this process
                plain = measure_plain(config, args, device)
                plain["app_over_plain"] = rows[-1]["step_ms"] / plain["step_ms"]
                results["plain"] = plain
                print(f"{'  plain PyTorch loop':<32} {plain['step_ms']:8.1f} ms/step", flush=True)
            write()
    if not (args.skip_mnist or args.smoke or args.cpu):
        results["mnist"] = mnist_time_to_accuracy(args, device)
    results["settings"]["load"].append(os.getloadavg()[0])
    write()
    print(markdown(results))
    print(f"wrote {stem}.json/.md")
    return results


if __name__ == "__main__":
    main()
