"""Step time of every parallel mode against plain PyTorch loops: ``python -m bench.step_time``.

One ``torchrun`` job (2 gloo processes on CPU) keeps its process group and, for each model and precision, runs
rounds; each round runs ``--steps`` training steps of every mode in turn (A B C ... A B C ...), so a change of machine
load hits every mode alike. The first ``--warmup`` rounds are discarded; the step time is the median (with p10/p90)
of the start-to-start intervals between consecutive steps (each round runs ``--steps`` + 1 steps; the first
interval, which holds lazy optimizer-state creation, is dropped for every mode). A mode's ratio to its counterpart
is the median over rounds of the per-round ratio of medians. Plain loops: forward, loss, backward, optimizer step,
zero_grad. The app's modes run the real Lightning ``Trainer.fit`` with the app's ``ImageClassifier`` and strategy
(a new Trainer per round, its set-up outside the timed steps), so Lightning's per-step overhead is measured.
Data: synthetic in-memory batches (random images and labels, different per rank), the same for every mode.
Single-device modes run on rank 0 while rank 1 waits; every process uses one CPU thread.
Writes ``bench/results/step_time.{json,md}`` and ``step_time_modes.png`` / ``step_time_scaling.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.strategies.modes import REFERENCE, declared_modes
from bench.common import RESULTS, batch_clock, figure, load_remark, machine_line, progress, run_job, summary
from bench.common import report as report_results
from core.layout import layout_of


def timed_modes() -> dict[str, tuple[int, tuple[str, ...], str | None]]:
    """mode -> (processes it uses, plain counterpart(s) its ratio is taken against, app strategy name or None).

    The plain PyTorch loops, the app on one device, then every mode the registry declares (``declared_modes``): a
    one-process mode against the plain single-device loop, the reference ``ddp`` against plain DDP (and once more with
    the default config's per-step callbacks: AMP health, throughput, signal and lost-rank checks, stragglers, the hang
    watch), every other against the app's ``ddp`` and plain DDP, or the plain hand-averaging loop of the PyTorch
    tutorial when it averages by hand. A new strategy shows up here without an edit."""
    import app.strategies  # noqa: F401  (registers the app's strategy names)

    ref = f"app_{REFERENCE}"
    modes: dict[str, tuple[int, tuple[str, ...], str | None]] = {
        "plain_single": (1, (), None),
        "plain_ddp": (2, (), None),
        "plain_tutorial": (2, ("plain_ddp",), None),
        "app_single": (1, ("plain_single",), "auto"),
    }
    for name in declared_modes():
        layout = layout_of(name)
        if layout.one_process:
            modes[f"app_{name}"] = (1, ("plain_single",), name)
        elif name == REFERENCE:
            modes[ref] = (2, ("plain_ddp",), name)
            modes[CALLBACKS] = (2, (ref, "plain_ddp"), name)
        else:
            modes[f"app_{name}"] = (2, (ref, "plain_tutorial" if layout.averages_by_hand else "plain_ddp"), name)
    return modes


CALLBACKS = f"app_{REFERENCE}_callbacks"
MODES = timed_modes()
MODELS = {"cnn": ("mnist_cnn", 1), "resnet18": ("resnet18", 3)}  # --models name -> (zoo arch, input channels)


class Batches:
    """The same pre-built batches on every pass: an iterable with a length, so no sampler or collation is timed."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _intervals(starts: list[float]) -> list[float]:
    """Start-to-start intervals, without the first (lazy optimizer state, first-touch allocations)."""
    return [b - a for a, b in zip(starts, starts[1:], strict=False)][1:]


def _plain_round(
    net: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, precision: str, device: torch.device,
    after_backward: Callable[[], None] | None = None,
) -> list[float]:  # fmt: skip
    """K steps of the plain loop; returns the step intervals."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    starts = []
    for x, y in batches:
        _sync(device)
        starts.append(time.perf_counter())
        with autocast():
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return _intervals(starts)


def average_gradients(model: nn.Module) -> None:
    """The PyTorch distributed tutorial's gradient averaging: one all_reduce per parameter, then divide."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _group(task: dict, arch: str, channels: int, precision: str, device: torch.device) -> dict[str, list[list[float]]]:
    """Every mode of one model and precision, interleaved round by round; rank 0's step intervals per mode."""
    from lightning.pytorch import Trainer
    from torch.nn.parallel import DistributedDataParallel

    from modules import ImageClassifier

    rank, world = dist.get_rank(), dist.get_world_size()
    size = task["image_size"] if channels == 3 else 28
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = Batches(
        [
            (
                torch.randn(task["batch_size"], channels, size, size, generator=generator).to(device),
                torch.randint(0, 10, (task["batch_size"],), generator=generator).to(device),
            )
            for _ in range(task["steps"] + 1)
        ]
    )
    torch.manual_seed(0)
    base = ImageClassifier(arch=arch, num_classes=10, in_channels=channels, optimizer=_sgd)
    plain: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable[[], None] | None]] = {}
    for mode in (m for m in task["modes"] if m.startswith("plain_")):
        net = copy.deepcopy(base.net).to(device)
        if mode == "plain_ddp":
            net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        elif mode == "plain_tutorial":
            for tensor in net.state_dict().values():
                dist.broadcast(tensor, src=0)
        hook = (lambda n=net: average_gradients(n)) if mode == "plain_tutorial" else None
        plain[mode] = (net, _sgd(net.parameters()), hook)
    apps = {m: copy.deepcopy(base) for m in task["modes"] if m.startswith("app_")}
    times: dict[str, list[list[float]]] = {m: [] for m in task["modes"]}  # per mode: per round: intervals
    for round_index in range(task["warmup"] + task["rounds"]):
        progress(f"{arch} {precision}: round {round_index + 1}/{task['warmup'] + task['rounds']}")
        for mode in task["modes"]:
            processes, _, strategy = MODES[mode]
            dist.barrier()
            if processes == 1 and rank != 0:
                continue  # a single-device mode: rank 0 alone (the others wait at the next barrier)
            if mode in plain:
                net, optimizer, hook = plain[mode]
                intervals = _plain_round(net, optimizer, batches, precision, device, hook)
            else:
                clock = batch_clock(device)  # the time at which every training batch starts
                # dp refuses a multi-process launch (torchrun's WORLD_SIZE); here rank 0 runs it as one process
                env = {"WORLD_SIZE": "1"} if layout_of(strategy).one_process else {}
                with _env(env):
                    trainer = Trainer(
                        accelerator=device.type, devices=world if processes > 1 else 1, strategy=strategy,
                        precision=precision, max_epochs=1, limit_train_batches=task["steps"] + 1, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock, *_default_callbacks(mode)],
                        default_root_dir=task["workdir"],
                    )  # fmt: skip
                    trainer.fit(apps[mode], train_dataloaders=batches)
                intervals = _intervals(clock.starts)
            if round_index >= task["warmup"]:
                times[mode].append(intervals)
    return times


def _default_callbacks(mode: str) -> list:
    """For ``app_ddp_callbacks``: the callbacks of ``configs/mnist.yaml`` that act on every training step."""
    if mode != CALLBACKS:
        return []
    from app.callbacks import AMPHealth, LostRank, RNGState, SIGTERMCheckpoint, SLURMRequeue, Stragglers, Throughput
    from app.callbacks.hang_watch import HangWatch

    every_step = [AMPHealth(), Throughput(), SLURMRequeue(), RNGState(), SIGTERMCheckpoint(), LostRank()]
    return [*every_step, Stragglers(), HangWatch()]  # HangWatch: what the CLI adds to every multi-process run


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker(task: dict) -> dict[str, Any]:
    """Runs inside the torchrun job (see ``bench.common.run_job``): every model x precision group in turn."""
    import app.strategies  # noqa: F401  (registers the app's strategy names)

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    cuda = task.get("accelerator") == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    out = {}
    for name in task["models"]:
        arch, channels = MODELS[name]
        for precision in task["precisions"]:
            if f"{name}:{precision}" not in task["skip"]:
                out[f"{name} {precision}"] = _group(task, arch, channels, precision, device)
    return out


def analyse(raw: dict[str, dict[str, list[list[float]]]], batch_size: int, world: int) -> dict[str, Any]:
    """Per group: each mode's median/p10/p90 step time over all kept intervals, images per second, and its ratio to
    each counterpart: the median over rounds of the per-round ratio of medians (a pair of modes measured minutes
    apart would see different machine loads; within a round they run back to back)."""
    groups = {}
    for group, rounds in raw.items():
        modes = {}
        for mode, per_round in rounds.items():
            processes = MODES[mode][0]
            stats = summary([t for r in per_round for t in r])
            images = batch_size * (world if processes > 1 else 1)
            stats["world_size"] = world if processes > 1 else 1
            stats["images_per_step"] = images
            stats["img_per_s"] = images / stats["median_ms"] * 1e3 if stats["n"] else float("nan")
            modes[mode] = stats
        for mode, stats in modes.items():
            others = [o for o in MODES[mode][1] if o in modes]
            stats["ratio"] = {
                o: statistics.median(
                    statistics.median(a) / statistics.median(b) for a, b in zip(rounds[mode], rounds[o], strict=True)
                )
                for o in others
            }
            stats["ratio_of_medians"] = {o: stats["median_ms"] / modes[o]["median_ms"] for o in others}
        groups[group] = modes
    return groups


# the targets: (mode, counterpart) -> largest acceptable step-time ratio
TARGETS = {
    ("app_single", "plain_single"): 1.05,
    ("app_ddp", "plain_ddp"): 1.03,
    ("app_ddp_callbacks", "app_ddp"): 1.02,
    ("app_allreduce", "app_ddp"): 1.05,
    ("app_allreduce_overlap", "app_ddp"): 1.05,
}


def models_line(results: dict[str, Any]) -> str:
    """The models measured (the groups' "<model> <precision>" names), resnet18 with its input size."""
    settings = results["settings"]
    names = dict.fromkeys(group.split()[0] for group in results["groups"])
    return " and ".join(f"resnet18 at {settings['image_size']} px" if n == "resnet18" else MODELS[n][0] for n in names)


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [
        "# Step time: the app's modes against plain PyTorch",
        "",
        f"Machine: {machine_line(results['machine'])}. Load average (1 min) before / after: "
        f"{results['load'][0]:.1f} / {results['load'][1]:.1f} (the benchmark's own 2 processes load 2 cores; "
        f"{load_remark(results['load'], 2)}).",
        f"Settings: {settings['world_size']} gloo processes x 1 thread, synthetic in-memory data, "
        f"per-process batch {settings['batch_size']}, {models_line(results)}, "
        f"{settings['rounds']} measured rounds x {settings['steps'] - 1} kept step times per mode (after "
        f"{settings['warmup']} warm-up rounds), interleaved; median (p10-p90) of the step intervals; ratio = "
        f"median over rounds of the per-round ratio. Command: `{settings['command']}`",
        "",
    ]
    if settings.get("skip"):
        lines += [f"Left out (`--skip`): {', '.join(settings['skip'])}; see bench/README.md.", ""]
    for group, modes in results["groups"].items():
        lines += [f"## {group}", "", "| mode | world | step ms, median (p10-p90) | img/s | ratio |"]
        lines.append("|---|---|---|---|---|")
        for mode, s in modes.items():
            ratio = ", ".join(f"{v:.3f}x {k}" for k, v in s["ratio"].items()) or "-"
            for (a, b), target in TARGETS.items():
                if a == mode and b in s["ratio"]:
                    ratio += f" (target <= {target}: {'met' if s['ratio'][b] <= target else 'MISSED'})"
            lines.append(
                f"| {mode} | {s['world_size']} | {s['median_ms']:.1f} ({s['p10_ms']:.1f}-{s['p90_ms']:.1f}) "
                f"| {s['img_per_s']:.0f} | {ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """``step_time_modes.png`` (median and p10-p90 per mode) and ``step_time_scaling.png`` (img/s vs world size)."""
    groups = results["groups"]
    paths = [out / "step_time_modes.png", out / "step_time_scaling.png"]
    size = (8, 2.2 + 0.35 * len(MODES) * len(groups))
    with figure(paths[0], nrows=len(groups), ncols=1, figsize=size, squeeze=False) as (_, axes):
        for ax, (group, modes) in zip(axes[:, 0], groups.items(), strict=True):
            names = list(modes)
            med = [modes[m]["median_ms"] for m in names]
            err = [[med[i] - modes[m]["p10_ms"] for i, m in enumerate(names)],
                   [modes[m]["p90_ms"] - med[i] for i, m in enumerate(names)]]  # fmt: skip
            colors = ["tab:gray" if m.startswith("plain_") else "tab:blue" for m in names]
            ax.barh(names, med, xerr=err, color=colors, capsize=3)
            ax.invert_yaxis()
            ax.set_title(f"{group}: step time (median, p10-p90); gray = plain PyTorch")
            ax.set_xlabel("ms per step")
    # bars side by side, one panel per model: the plain loop's and the app's lines of one model lay on each other
    with figure(paths[1], ncols=len(groups), figsize=(3.6 * len(groups), 3.4), squeeze=False) as (_, axes):
        for ax, (group, modes) in zip(axes[0], groups.items(), strict=True):
            for k, (kind, (one, two)) in enumerate({"plain": ("plain_single", "plain_ddp"),
                                                     "app": ("app_single", "app_ddp")}.items()):  # fmt: skip
                if one in modes and two in modes:
                    values = [modes[one]["img_per_s"], modes[two]["img_per_s"]]
                    bars = ax.bar([x + 0.4 * k for x in (0, 1)], values, width=0.4, label=kind,
                                  color="tab:gray" if kind == "plain" else "tab:blue")  # fmt: skip
                    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
            ax.set_xticks([0.2, 1.2], ["1 process", f"{results['settings']['world_size']} (DDP)"])
            ax.set_title(group, fontsize=9)
            ax.set_ylabel("images / s (all processes)")
            ax.legend(fontsize=7, loc="lower right")
    return paths


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,resnet18", help="comma-separated: cnn (mnist_cnn), resnet18")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated Lightning precisions")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument(
        "--steps", type=int, default=6, help="timed intervals per mode per round, the first dropped (default 6)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch (default 32)")
    parser.add_argument("--image-size", type=int, default=32, help="resnet18 input size in px (default 32)")
    parser.add_argument(
        "--skip", default="", help="comma-separated model:precision groups to leave out, e.g. resnet18:bf16-mixed"
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes of the distributed modes (default 2)")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    models, precisions = args.models.split(","), args.precisions.split(",")
    modes = [m for m in args.modes.split(",") if m]
    for value, known, flag in ((models, MODELS, "--models"), (modes, MODES, "--modes")):
        unknown = [v for v in value if v not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    skip = [g for g in args.skip.split(",") if g]
    bad = [g for g in skip if g.count(":") != 1 or g.split(":")[0] not in models or g.split(":")[1] not in precisions]
    if bad:
        parser.error(f"--skip: {', '.join(bad)} is not one of the groups: model:precision from --models/--precisions")
    if args.steps < 3 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps must be >= 3 (two intervals are dropped or kept per round), --rounds >= 1, --warmup >= 0")
    if args.nproc < 2:
        parser.error("--nproc must be >= 2: the distributed modes need a process group of several processes")
    if args.accelerator == "cuda" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--accelerator cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    if "16-mixed" in precisions and args.accelerator == "cpu":
        parser.error("--precisions 16-mixed runs on GPUs only (on CPU Lightning uses bf16); use bf16-mixed")
    command = "python -m bench.step_time " + " ".join(argv if argv is not None else sys.argv[1:]).strip()
    settings = {
        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "batch_size": args.batch_size,
        "image_size": args.image_size, "accelerator": args.accelerator, "world_size": args.nproc, "command": command,
        "skip": skip,
    }  # fmt: skip
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        raw = run_job([task(models, precisions, modes, settings, tmp)], args.nproc, Path(tmp), progress=True)
    raw = raw["step_time"]
    results = report(raw, settings, [*load, os.getloadavg()[0]], args.out)
    print(markdown(results))
    return results


def task(models: list[str], precisions: list[str], modes: list[str], settings: dict, workdir: str) -> dict[str, Any]:
    """The job's task for :func:`worker` (see ``bench.common.run_job``)."""
    keys = ("steps", "rounds", "warmup", "batch_size", "image_size", "accelerator")
    settings = {"skip": [], **settings}
    return {"name": "step_time", "worker": "bench.step_time:worker", "models": models, "precisions": precisions,
            "modes": modes, "workdir": workdir, "skip": settings["skip"], **{k: settings[k] for k in keys}}  # fmt: skip


def report(raw: dict[str, Any], settings: dict[str, Any], load: list[float], out: Path) -> dict[str, Any]:
    """Statistics, table and plots of the job's timings; writes ``step_time.{json,md}`` and the PNGs into ``out``."""
    settings = {**settings, "data": "synthetic in-memory batches", "threads_per_process": 1}
    figures = {"groups": analyse(raw, settings["batch_size"], settings["world_size"])}
    return report_results(out / "step_time", settings, load, figures, markdown, lambda r: plot(r, out))


if __name__ == "__main__":
    main()
