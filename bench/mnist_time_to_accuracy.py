"""MNIST time to 99% test accuracy: the app's default config next to the PyTorch MNIST example's recipe.

One command, both runs in one process on the same machine, data and thread count::

    .venv/bin/python -m bench.mnist_time_to_accuracy     # CPU; writes bench/results/mnist_time_to_accuracy.*
    .venv/bin/python -m bench.mnist_time_to_accuracy --accelerator cuda --out /tmp/x   # what bench/gpu.py runs
    .venv/bin/python -m bench.mnist_time_to_accuracy --smoke   # code-path check: 1 epoch of 5 batches per run

(a) ``app``: ``configs/mnist.yaml`` exactly as ``python cli.py fit`` runs it (only ``default_root_dir`` points into a
scratch folder), built by the app's own CLI (``app.command.main(run=False)``) and trained with ``trainer.fit``.
(b) ``pytorch_example``: the recipe of pytorch/examples ``mnist/main.py`` as a plain PyTorch loop: the same network
(``mnist_cnn``), Normalize((0.1307,), (0.3081,)), Adadelta lr 1.0, StepLR(step_size=1, gamma=0.7), batch 64 shuffled
over the 60k training images, test batch 1000; it stops at the epoch that reaches the target (or at ``--max-epochs``).

After every epoch both evaluate the official 10k test set. Reported per epoch: test accuracy, training wall time
since the start of training excluding the test evaluations, and including them. The app's figure includes what the
default run does besides training (its 5k validation pass per epoch, checkpoints, logging): that is what a user waits
for. Process start-up (imports, ~10 s on a 2-core CPU) is not in either figure.
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bench.common import batch_clock, figure, machine, machine_line, write_json
from datamodules.mnist import ensure_mnist, load_split

ROOT = Path(__file__).resolve().parent.parent
NAME = "mnist_time_to_accuracy"
SMOKE_APP_ARGS = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "2"]
ANCHOR = "tuomaso/train_mnist_fast: 99.04% (mean of 30 seeds) in 0.76 s of training on a GTX 1660 Ti"


def device_for(accelerator: str) -> torch.device:
    """The torch device of ``--accelerator`` (cpu, cuda/gpu, or auto)."""
    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class TestSetClock:
    """Evaluates the 10k test set after each epoch and keeps the clock of the run, without the evaluation time."""

    def __init__(self, data_dir: Path, device: torch.device) -> None:
        images, labels = load_split(data_dir, train=False)
        self.images, self.labels, self.device = images.to(device), labels.to(device), device
        self.epochs: list[dict[str, float]] = []
        self.start = self.eval_seconds = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def begin(self) -> None:
        self._sync()
        self.start, self.eval_seconds = time.perf_counter(), 0.0

    @torch.no_grad()
    def epoch_end(self, model: torch.nn.Module, images_seen: int) -> float:
        """Records one epoch: test accuracy (%) and both wall times; returns the accuracy."""
        self._sync()
        now = time.perf_counter()
        train_s = now - self.start - self.eval_seconds  # the clock without every evaluation before this one
        was_training = model.training
        model.eval()
        correct = sum(
            int((model(self.images[i : i + 1000]).argmax(-1) == self.labels[i : i + 1000]).sum())
            for i in range(0, len(self.labels), 1000)
        )
        model.train(was_training)
        self._sync()
        self.eval_seconds += time.perf_counter() - now
        acc = 100.0 * correct / len(self.labels)
        self.epochs.append(
            {
                "epoch": len(self.epochs) + 1,
                "test_acc": acc,
                "train_wall_s": train_s,
                "wall_with_test_eval_s": time.perf_counter() - self.start,
                "images_per_s": images_seen / train_s,
            }
        )
        print(f"  epoch {len(self.epochs)}: test {acc:.2f}%  {train_s:.1f} s training", flush=True)
        return acc


def run_app(data_dir: Path, accelerator: str, extra: list[str]) -> dict[str, Any]:
    """The default config, built by the app's CLI and trained with ``trainer.fit``; test set after every epoch."""
    from app.command import main

    with tempfile.TemporaryDirectory(prefix="bench-mnist-app-") as root:
        args = ["--trainer.default_root_dir", root, "--data.data_dir", str(data_dir)]
        cli = main([*args, "--trainer.accelerator", accelerator, *extra], run=False)
        clock = TestSetClock(data_dir, device_for(accelerator))
        # after each epoch (its validation and checkpoint included): the test set, and the clock without it
        cli.trainer.callbacks.append(batch_clock("cpu", lambda i: False, on_epoch_end=clock.epoch_end))
        clock.begin()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        fit_s = time.perf_counter() - clock.start
    model, data = cli.model.hparams, cli.datamodule.hparams
    recipe = (
        f"configs/mnist.yaml: {model.arch}, {type(cli.trainer.optimizers[0]).__name__}, "
        f"batch {data.batch_size}, {cli.trainer.max_epochs} epochs{' ' + ' '.join(extra) if extra else ''}"
    )
    return {"recipe": recipe, "epochs": clock.epochs, "fit_wall_s": fit_s}


def run_pytorch_example(
    data_dir: Path,
    device: torch.device,
    max_epochs: int,
    target: float,
    full: bool,
    seed: int,
    limit: int | None = None,
):
    """pytorch/examples mnist/main.py's recipe as a plain loop (in-memory tensors, as the app loads them)."""
    from modules.zoo.mnist_cnn import mnist_cnn

    torch.manual_seed(seed)
    images, labels = load_split(data_dir, train=True)
    loader = DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True)
    model = mnist_cnn().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    clock = TestSetClock(data_dir, device)
    clock.begin()
    seen = 0
    for _ in range(max_epochs):
        model.train()
        for step, (x, y) in enumerate(loader):
            if limit is not None and step >= limit:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # = the example's log_softmax + nll_loss
            optimizer.step()
            seen += len(y)
        scheduler.step()
        if clock.epoch_end(model, seen) >= target and not full:
            break
    recipe = "pytorch/examples mnist: mnist_cnn, Adadelta lr 1.0, StepLR 0.7, batch 64, 60k training images"
    return {"recipe": recipe, "epochs": clock.epochs, "fit_wall_s": time.perf_counter() - clock.start}


def reached(run: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The first epoch at or above ``target`` percent, or None."""
    return next((e for e in run["epochs"] if e["test_acc"] >= target), None)


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"# MNIST time to {s['target']}% test accuracy" + (" (SMOKE: 5 batches per run)" if s.get("smoke") else ""),
        "",
        f"Machine: {machine_line(results['machine'])}; {s['threads']} torch threads; device {s['device']}.",
        "Load average (1 min) before/after each run: "
        + ", ".join(f"{name} {load}" for name, load in s["load"].items())
        + f". Command: `{s['command']}`",
        "",
        "Training wall time from the start of training (imports and start-up excluded), without and with the",
        "test-set evaluation after each epoch. The app's time includes its own 5k validation pass and checkpoints.",
        "",
        f"| run | recipe | epochs to {s['target']}% | wall to {s['target']}% (s) | with test eval (s) "
        "| final test acc | img/s | whole run (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results["runs"].items():
        hit, last = reached(run, s["target"]), run["epochs"][-1]
        to = (
            (str(hit["epoch"]), f"{hit['train_wall_s']:.1f}", f"{hit['wall_with_test_eval_s']:.1f}")
            if hit
            else (f"not in {len(run['epochs'])}", "-", "-")
        )
        lines.append(
            f"| {name} | {run['recipe']} | {' | '.join(to)} | {last['test_acc']:.2f}% | {last['images_per_s']:.0f} "
            f"| {run['fit_wall_s']:.1f} |"
        )
    app, ref = (reached(results["runs"].get(k, {"epochs": []}), s["target"]) for k in ("app", "pytorch_example"))
    if app and ref:
        lines += ["", f"Speed-up to {s['target']}%: {ref['train_wall_s'] / app['train_wall_s']:.2f}x."]
    if s.get("warmup"):
        lines += ["", "The app's run is the second in this process: a first, untimed run warmed the device up."]
    if s["device"].startswith("cuda"):
        lines += ["", f"Anchor: {ANCHOR}."]
    lines += [
        "",
        "Per epoch:",
        "",
        "| run | epoch | test acc | wall (s) | with test eval (s) |",
        "|---|---|---|---|---|",
    ]
    for name, run in results["runs"].items():
        for e in run["epochs"]:
            lines.append(
                f"| {name} | {e['epoch']} | {e['test_acc']:.2f}% | {e['train_wall_s']:.1f} "
                f"| {e['wall_with_test_eval_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    with figure(path, figsize=(6.4, 4.0)) as (_, ax):
        for name, run in results["runs"].items():
            ax.plot([0] + [e["train_wall_s"] for e in run["epochs"]], [None] + [e["test_acc"] for e in run["epochs"]],
                    marker="o", label=f"{name}: {run['recipe'].split(', batch')[0]}")  # fmt: skip
        ax.axhline(results["settings"]["target"], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("training wall time (s, without test evaluation)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(97.0, 100.0)
        ax.set_title(f"MNIST test accuracy vs time ({results['settings']['device']})")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu", help="cpu, cuda (or gpu), auto; for both runs")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads, both runs")
    parser.add_argument("--target", type=float, default=99.0, help="test accuracy to reach, percent")
    parser.add_argument("--max-epochs", type=int, default=5, help="cap of the PyTorch example's run")
    parser.add_argument("--full", action="store_true", help="run the example for --max-epochs even after the target")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the example's run (the app: its config's)")
    parser.add_argument("--limit-batches", type=int, help="code-path check: batches per epoch of the example's run")
    parser.add_argument("--only", choices=["app", "pytorch_example"], help="run one of the two")
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data")
    parser.add_argument(
        "--smoke", action="store_true", help="code-path check: 1 epoch of 5 training batches per run (results in runs/)"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON/MD/PNG (default bench/results)")
    parser.add_argument("--name", default=NAME, help=f"the results files' name (default {NAME})")
    parser.add_argument("--warmup", action="store_true", help="train the app's run once untimed first (on a GPU)")
    parser.add_argument("app_args", nargs="*", help="extra app CLI arguments after --, e.g. -- --model.arch mnist_cnn")
    args = parser.parse_args(argv)
    if args.smoke:  # both runs cut to 5 training batches of one epoch; the test-set evaluation stays whole
        args.max_epochs, args.limit_batches = 1, 5
        args.app_args = [*SMOKE_APP_ARGS, *args.app_args]
    args.out = args.out or (ROOT / "runs" / "bench-smoke" if args.smoke else ROOT / "bench" / "results")
    torch.set_num_threads(args.threads)
    data_dir = ensure_mnist(args.data_dir)
    device = device_for(args.accelerator)
    command = ["python -m bench.mnist_time_to_accuracy", *(argv if argv is not None else sys.argv[1:])]
    results: dict[str, Any] = {
        "machine": machine(),
        "settings": {"target": args.target, "threads": args.threads, "device": str(device), "load": {},
                     "command": " ".join(command), "smoke": args.smoke},
        "runs": {},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("app", "pytorch_example"):
        if args.only not in (None, name):
            continue
        print(f"{name}:", flush=True)
        if name == "app" and args.warmup:  # CUDA context, cuDNN's choices, the allocator: paid once, not timed
            print("  warm-up run (not reported)", flush=True)
            run_app(data_dir, args.accelerator, args.app_args)
            results["settings"]["warmup"] = True
        before = os.getloadavg()[0]
        if name == "app":
            results["runs"][name] = run_app(data_dir, args.accelerator, args.app_args)
        else:
            results["runs"][name] = run_pytorch_example(
                data_dir, device, args.max_epochs, args.target, args.full, args.seed, args.limit_batches
            )
        results["settings"]["load"][name] = f"{before:.1f}/{os.getloadavg()[0]:.1f}"
        # written after each run: a long second run that is stopped leaves the first one's results
        write_json(args.out / f"{args.name}.json", results)
        (args.out / f"{args.name}.md").write_text(markdown(results))
        plot(results, args.out / f"{args.name}.png")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
