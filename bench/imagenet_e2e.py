"""ImageNet end to end: ``python -m bench.imagenet_e2e`` trains the ImageNet recipe from JPEG files on one GPU.

The recipe as a user runs it (``configs/imagenet.yaml`` through the app's CLI: on CUDA bf16-mixed, channels_last,
compiled, normalised on the device), ResNet-50 at 224 px, batch 256, on ImageNet-like JPEGs (``bench.loader``'s:
about 500x375, quality 90, cut from the test photos; ``--images`` of them hard-linked into 1000 class folders, so that
the network, and with it the compiled graphs, are the synthetic fit's), in one process, one fit after the other:

1. synthetic uint8 batches (``--data.synthetic true``): the rate of the compiled step with nothing to load, the
   reference every other row is divided by; its first step pays the compile (its caches in the run folder);
2. the JPEG files with each decoder of ``--decoders``: ``gpu`` (nvImageCodec on the GPU: the loader workers read
   bytes and draw the crops) and ``cpu`` (TorchCodec in the loader workers), with ``--data.num_workers auto``;
3. after the first decoder (unless ``--no-restart``): a second process starting the synthetic fit in the same run
   folder, as a restart or requeue does: its time to the end of the first step against the first process's (the
   compile cache);
4. with ``--recipes classic,modern``: each decoder's fit again with the modern recipe's per-step work at the same
   sizes (``bench.recipe_cost.MODERN_ARGS``: TrivialAugment, random erasing, mixup/cutmix, repeated augmentation, the
   moving average every 32 steps): what the augmentations cost on the CPU loader and on the GPU decoding path;
5. with ``--determinism``, last: the synthetic fit again with ``--trainer.deterministic true``: what exact resume
   costs.

Each fit is timed from the start of step ``--warmup`` (at least the batches the loader workers had in flight when
they started, ``workers x prefetch_factor``, so that the rate is the loader's own) to the end of the last of
``--steps`` more, by CUDA events recorded at those steps and read after one synchronize at the end (``Marks``: no
step waits for the GPU; on the CPU the wall clock); then the evaluation path (``trainer.validate``: the evaluation
transforms and graph) the same way over as many warm-up batches and ``eval_steps`` timed ones. Per row: images/s,
against the synthetic rate (the GPU's busy share), the data wait and Lightning's loop as the training summary
measures them (``app.callbacks.throughput.gap_parts``, over the timed steps and, from the run's ``Throughput``, over
the whole fit), the GPU utilisation NVML reports (sampled at each step's end), the time to the end of the first
step, and the evaluation's images/s. The results name the decoders that ran with their versions (TorchCodec,
nvImageCodec) and why ``auto`` would choose as it does.

Writes ``bench/results/imagenet_e2e_<gpu>.{json,md}`` (``--out``). ``--smoke``: the CPU at tiny sizes (resnet18,
32 px, batch 4), nvImageCodec's CPU backend for ``gpu``: a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, ROOT, machine, machine_line, write_json

SMOKE_TITLE = {
    False: " (SMOKE: CPU, tiny sizes, not a measurement)",
    True: " (CPU, tiny sizes, compiled: img/s are no figure; the first step compares a cold compile with a restart's)",
}
GPU_SIZES = {"arch": "resnet50", "batch": 256, "px": 224, "warmup": 15, "steps": 30, "eval_steps": 10, "images": 512,
             "workers": "auto"}  # fmt: skip
SMOKE_SIZES = {"arch": "resnet18", "batch": 4, "px": 32, "warmup": 2, "steps": 2, "eval_steps": 2, "images": 8,
               "workers": "1"}  # fmt: skip
CLASSES = 1000  # the synthetic fit's: the JPEG fits then build the same network and reuse its compiled graphs


def versions() -> dict[str, Any]:
    """The decoders this process can run: TorchCodec (and whether it loads with this torch), nvImageCodec (and
    whether its GPU decoders can: nvJPEG), and what ``--data.decode auto`` would pick here and why."""
    from datamodules.decode import _torchcodec
    from datamodules.gpu_decode import gpu_decoding, nvimgcodec

    out: dict[str, Any] = {}
    try:
        out["torchcodec"] = importlib.metadata.version("torchcodec")
    except importlib.metadata.PackageNotFoundError:
        out["torchcodec"] = None
    out["torchcodec_loads"] = _torchcodec() is not None
    module, _ = nvimgcodec()
    out["nvimgcodec"] = getattr(module, "__version__", None)
    out["auto_picks_gpu"], out["auto_reason"] = gpu_decoding(torch.cuda.is_available())
    return out


def jpeg_tree(folder: Path, unique: int, train: int, val: int) -> Path:
    """``unique`` ImageNet-like JPEGs hard-linked into ``train`` files over :data:`CLASSES` class folders, and 10
    into ``val`` files in ``val/`` (each at least one per class)."""
    from bench.loader import make_jpegs

    sources = {"train": make_jpegs(folder / "flat", unique), "val": make_jpegs(folder / "flat_val", 10, seed=1)}
    for split, total in (("train", train), ("val", val)):
        for i in range(max(total, CLASSES)):
            target = folder / split / f"class{i % CLASSES:04d}"
            target.mkdir(parents=True, exist_ok=True)
            os.link(sources[split][i % len(sources[split])], target / f"{i:06d}.jpg")
    return folder


def fit_args(root: Path, z: dict[str, Any], steps: int, extra: list[str], device: str) -> list[str]:
    """The ``cli.py fit`` arguments (without the subcommand: the CLI only builds, the caller fits)."""
    return [
        "--config", str(ROOT / "configs" / "imagenet.yaml"), "--model.arch", z["arch"],
        "--data.batch_size", str(z["batch"]), "--data.image_size", str(z["px"]), "--data.num_workers", z["workers"],
        "--trainer.max_steps", str(steps), "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.logger", "false", "--trainer.accelerator", device,
        "--trainer.devices", "1", "--trainer.default_root_dir", str(root), *extra,
    ]  # fmt: skip


class Marks:
    """Time marks that never wait for the GPU: on CUDA an event recorded on the current stream per mark, read after
    one ``torch.cuda.synchronize()`` once the fit is over (:meth:`seconds`); elsewhere ``time.perf_counter()``. (A
    synchronize per step would add the host's work to the GPU's instead of overlapping it: every rate too low.)"""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """From mark ``start`` to mark ``end`` (0 if either is missing)."""
        if start is None or end is None:
            return 0.0
        if not self.cuda:
            return end - start
        torch.cuda.synchronize()  # after the fit: the events' times are known
        return start.elapsed_time(end) / 1000


def clock(device: str, warmup: int) -> Any:
    """The timing callback: marks (:class:`Marks`) at the start of training step ``warmup`` and the end of every step
    after, and the same for the evaluation's batches; the gap parts (data wait, loop) of the timed steps, NVML's GPU
    utilisation at each timed step's end, and the seconds from the fit's start to the end of its first step."""
    from lightning.pytorch import Callback

    from app.callbacks.throughput import gap_parts

    cuda = device == "cuda"

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks = Marks(cuda)
            self.start = self.end = self.fit_start = self.first_step = self.eval_start = self.eval_end = None
            self.images, self.eval_images, self.data, self.loop = 0, 0, 0.0, 0.0
            self.last_end: float | None = None
            self.utilisation: list[float] = []

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            self.fit_start = self.marks.mark()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            begin = time.perf_counter()
            if batch_idx > warmup:  # the gaps between timed steps, as the training summary splits them
                data, loop = gap_parts(trainer, begin, self.last_end)
                self.data, self.loop = self.data + data, self.loop + loop
            if batch_idx == warmup:
                self.start = self.marks.mark()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.first_step = self.marks.mark()
            if batch_idx >= warmup:
                self.images += len(batch[1])
                self.end = self.marks.mark()
                if cuda:
                    with contextlib.suppress(Exception):  # no NVML bindings: the figure stays empty
                        self.utilisation.append(float(torch.cuda.utilization()))
            self.last_end = time.perf_counter()

        def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *_: Any) -> None:
            if batch_idx == warmup:
                self.eval_start = self.marks.mark()

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    *_: Any) -> None:  # fmt: skip
            if batch_idx >= warmup:
                self.eval_images += len(batch[1])
                self.eval_end = self.marks.mark()

        def rates(self) -> dict[str, float | None]:
            """After the fit: the timed seconds, the training and evaluation img/s, the first step's seconds."""
            seconds, evaluation = (
                self.marks.seconds(self.start, self.end),
                self.marks.seconds(self.eval_start, self.eval_end),
            )
            return {
                "seconds": seconds,
                "img_per_s": self.images / seconds if seconds > 0 else None,
                "eval_img_per_s": self.eval_images / evaluation if evaluation > 0 else None,
                "first_step_s": self.marks.seconds(self.fit_start, self.first_step),
            }

    return Clock()


def one_fit(name: str, root: Path, z: dict[str, Any], extra: list[str], device: str) -> dict[str, Any]:
    """One fit of the recipe through the app's CLI (checkpoints off), timed; its row."""
    from app.callbacks import Throughput
    from app.command import main
    from bench.gpu_check import _cli_saving_nothing

    warmup = int(z["warmup"])
    watch = clock(device, warmup)
    args = fit_args(root, z, warmup + int(z["steps"]), [*z.get("extra", []), *extra], device)
    began = time.perf_counter()
    try:
        cli = main(args, run=False, cli_class=_cli_saving_nothing())
        cli.trainer.callbacks.append(watch)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        # the evaluation path (its own geometry and compiled graph), timed as the training steps are
        cli.trainer.limit_val_batches = warmup + int(z["eval_steps"])
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    except Exception as err:  # noqa: BLE001 (a row that failed says why; the others still run)
        return {"input": name, "error": f"{type(err).__name__}: {err}"[-1500:], "wall_s": time.perf_counter() - began}
    rates = watch.rates()
    seconds = rates["seconds"]
    throughput = next((cb for cb in cli.trainer.callbacks if isinstance(cb, Throughput)), None)
    data_module = cli.datamodule
    row = {
        "input": name,
        "decoder": getattr(data_module, "decoder", None)
        if not getattr(data_module.hparams, "synthetic", False)
        else "-",
        "precision": str(cli.trainer.precision),
        "compiled": cli.model.net._compiled_call_impl is not None,
        "channels_last": bool(getattr(cli.model, "channels_last", False)),
        "workers": data_module.num_workers,
        "timed_steps": int(z["steps"]),
        "img_per_s": rates["img_per_s"],
        "eval_img_per_s": rates["eval_img_per_s"],
        "data_wait_frac": watch.data / seconds if seconds > 0 else None,
        "loop_frac": watch.loop / seconds if seconds > 0 else None,
        "summary_data_wait_frac": throughput.data_wait_frac if throughput else None,
        "summary_loop_frac": throughput.loop_frac if throughput else None,
        "gpu_utilisation_pct": sum(watch.utilisation) / len(watch.utilisation) if watch.utilisation else None,
        "first_step_s": rates["first_step_s"],
        "wall_s": time.perf_counter() - began,
    }
    decoded = getattr(data_module, "_batch_decoder", None)
    if decoded is not None:
        row["cpu_fallbacks"] = len(decoded.fallbacks)
    del cli
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def restart(root: Path, z: dict[str, Any], device: str, timeout: float) -> dict[str, Any]:
    """The synthetic fit again in a new process, in the same run folder (its compile cache): a restart."""
    out = root / "restart.json"
    command = [sys.executable, "-m", "bench.imagenet_e2e", "--restart-in", str(root), "--sizes", json.dumps(z),
               "--device", device]  # fmt: skip
    try:
        job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"input": "synthetic, restarted", "error": f"did not finish in {timeout:.0f} s"}
    if job.returncode != 0 or not out.exists():
        return {"input": "synthetic, restarted", "error": (job.stdout + job.stderr)[-1500:]}
    return json.loads(out.read_text())


def synthetic(z: dict[str, Any]) -> list[str]:
    train, val = (int(z["batch"]) * (int(z["warmup"]) + int(z[k]) + 1) for k in ("steps", "eval_steps"))
    return [
        "--data.synthetic",
        "true",
        "--data.synthetic_train_size",
        str(train),
        "--data.synthetic_val_size",
        str(val),
    ]


def markdown(results: dict[str, Any]) -> str:
    s, v = results["settings"], results["versions"]
    lines = [
        f"# ImageNet end to end from JPEG files{SMOKE_TITLE[bool(s.get('extra'))] if s['smoke'] else ''}",
        "",
        f"Machine: {machine_line(results['machine'])}. Command: `{s['command']}`",
        f"{s['arch']} at {s['px']} px, batch {s['batch']}, the ImageNet recipe's defaults on this device; "
        f"{s['images']} unique JPEGs (about 500x375, q90); {s['steps']} timed steps after {s['warmup']}. "
        f"TorchCodec {v['torchcodec']} (loads: {v['torchcodec_loads']}), nvImageCodec {v['nvimgcodec']}; "
        f"data.decode auto here: {'gpu' if v['auto_picks_gpu'] else 'cpu'} ({v['auto_reason']}).",
        "",
        "| input | decoder | precision | compiled | img/s | of synthetic | data wait (timed / whole fit) | loop | "
        "GPU util (NVML) | first step (s) | evaluation img/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    reference = next((r.get("img_per_s") for r in results["rows"] if r["input"] == "synthetic"), None)

    def pct(x: Any) -> str:
        return "-" if x is None else f"{x:.1%}"

    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['input']} | failed | | | | | | | | | {r['error'][-300:].replace('|', '/')} |")
            continue
        rate = r.get("img_per_s")
        share = pct(rate / reference) if rate and reference else "-"
        util = "-" if r.get("gpu_utilisation_pct") is None else f"{r['gpu_utilisation_pct']:.0f}%"
        evaluation = "-" if r.get("eval_img_per_s") is None else f"{r['eval_img_per_s']:,.0f}"
        lines.append(
            f"| {r['input']} | {r.get('decoder', '-')} | {r.get('precision', '-')} | {r.get('compiled', '-')} | "
            f"{'-' if rate is None else f'{rate:,.0f}'} | {share} | {pct(r.get('data_wait_frac'))} / "
            f"{pct(r.get('summary_data_wait_frac'))} | {pct(r.get('loop_frac'))} | {util} | "
            f"{r.get('first_step_s', 0):.1f} | {evaluation} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m bench.imagenet_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: a check of this script")
    parser.add_argument("--decoders", default="gpu,cpu", help="data.decode values to train with (gpu,cpu)")
    parser.add_argument("--determinism", action="store_true", help="also the synthetic fit with deterministic true")
    parser.add_argument("--recipes", default="classic", help="classic,modern: each decoder also with the modern recipe")
    parser.add_argument("--no-restart", action="store_true", help="leave out the second process (the compile cache)")
    parser.add_argument("--compile", action="store_true", help="compile on any device (auto: on CUDA only); with "
                        "--smoke, the CPU's cold compile against the restart's")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="timed steps per fit (30; smoke 3)")
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (bench/results; smoke: runs/bench-smoke)"
    )
    parser.add_argument("--restart-in", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restart_in:  # the second process of --restart: the synthetic fit in the first one's run folder
        z = json.loads(args.sizes)
        row = one_fit("synthetic, restarted", args.restart_in, z, synthetic(z), args.device)
        (args.restart_in / "restart.json").write_text(json.dumps(row))
        return None
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("no CUDA device here: run it on a GPU machine, or check the script with --smoke (CPU)")
    device = "cuda" if cuda and not args.smoke else "cpu"
    z = dict(SMOKE_SIZES if args.smoke else GPU_SIZES)
    z["extra"] = ["--model.compile", "true"] if args.compile else []
    if args.steps:
        z["steps"] = args.steps
    from datamodules.base import auto_workers, available_cpus

    workers = auto_workers(1, available_cpus()) if z["workers"] == "auto" else int(z["workers"])
    z["warmup"] = max(int(z["warmup"]), 2 * workers + 2)  # the batches in flight when the workers start, not timed
    info = machine()
    command = "python -m bench.imagenet_e2e " + " ".join(argv if argv is not None else sys.argv[1:]).strip()
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", info["gpu"] or "cpu").strip("-")
    out = args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else RESULTS)
    stem = out / f"imagenet_e2e_{gpu}{'_compile' if args.compile else ''}{'_smoke' if args.smoke else ''}"
    results: dict[str, Any] = {"machine": info, "settings": {**z, "smoke": args.smoke, "command": command},
                               "versions": versions(), "rows": []}  # fmt: skip

    def write() -> None:  # after each fit: a run cut short keeps the finished rows
        write_json(stem.with_suffix(".json"), results)
        stem.with_suffix(".md").write_text(markdown(results))

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        root, data = Path(tmp) / "run", Path(tmp) / "jpegs"
        steps = int(z["warmup"]) + int(z["steps"])
        evaluated = int(z["batch"]) * (int(z["warmup"]) + int(z["eval_steps"]) + 1)
        jpeg_tree(data, int(z["images"]), int(z["batch"]) * (steps + 1), evaluated)
        # the most wanted first (a run cut short keeps them): the reference, the first decoder, the restart
        decoders = [d for d in args.decoders.split(",") if d]
        jpegs = [(f"JPEG files, decode {d}", ["--data.data_dir", str(data), "--data.decode", d]) for d in decoders]
        fits: list[tuple[str, list[str] | None]] = [("synthetic", synthetic(z)), *jpegs[:1]]
        fits += [] if args.no_restart else [("synthetic, restarted", None)]
        fits += jpegs[1:]
        if "modern" in args.recipes.split(","):
            from bench.recipe_cost import MODERN_ARGS

            fits += [(f"JPEG files, decode {d}, modern recipe", ["--data.data_dir", str(data), "--data.decode", d,
                      *MODERN_ARGS]) for d in decoders]  # fmt: skip
        if args.determinism:
            fits.append(("synthetic, deterministic", [*synthetic(z), "--trainer.deterministic", "true"]))
        for name, extra in fits:
            row = restart(root, z, device, timeout=300) if extra is None else one_fit(name, root, z, extra, device)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            write()
    print(f"{markdown(results)}wrote {stem}.json/.md")
    return results


if __name__ == "__main__":
    main()
