"""Where the milliseconds of a short training step go: ``python -m bench.step_profile``.

One process, one CPU thread, ``mnist_cnn`` on synthetic in-memory batches (the short CNN step of
``bench/step_time.py``). First the wall time per step, in alternating rounds, of a plain PyTorch loop, of Lightning
alone (the same network in a minimal LightningModule, a Trainer without callbacks) and of the app (Lightning's
``Trainer``, the app's ``ImageClassifier`` and the default config's per-step callbacks, no logger); then one run of
the plain loop and of the app under ``cProfile``, whose cumulative times are sorted into what a step does: the
model's forward, backward, the optimizer, the classifier's metrics, ``self.log`` (Lightning's result bookkeeping),
each app callback, and Lightning's loop itself (the rest of ``_TrainingEpochLoop.advance``). cProfile charges every
Python call, so its milliseconds are larger than the wall times: read them against each other.
Writes ``bench/results/step_profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import RESULTS, machine_line
from bench.common import report as report_results

# row -> (file suffix, function name) whose cumulative time is the row's; several entries are summed
ROWS: dict[str, list[tuple[str, str]]] = {
    "forward (model)": [("torch/nn/modules/container.py", "forward")],
    "backward": [("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>")],
    "optimizer step": [("torch/optim/sgd.py", "step")],
    "zero_grad": [("torch/optim/optimizer.py", "zero_grad")],
    "classifier: training metrics": [("modules/classifier.py", "log_step")],
    "self.log (Lightning's bookkeeping)": [],  # see breakdown()
}
LOOP = ("lightning/pytorch/loops/training_epoch_loop.py", "advance")
LOGS = ("log", "log_dict")  # LightningModule's logging methods


def callbacks() -> list:
    """The callbacks of ``configs/mnist.yaml`` that have per-step hooks."""
    from app.callbacks import AMPHealth, LostRank, RNGState, SIGTERMCheckpoint, SLURMRequeue, Throughput

    return [AMPHealth(), Throughput(), SLURMRequeue(), RNGState(), SIGTERMCheckpoint(), LostRank()]


def batches(n: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(batch_size, 1, 28, 28, generator=g) for _ in range(n)]
    return [(x, torch.randint(0, 10, (batch_size,), generator=g)) for x in images]


def _ran(trainer: Any = None) -> dict[str, Any]:
    """What a timed run was, read from the run itself: the batches its Trainer trained (None: no Trainer) and its
    callbacks besides the clock, so the results show that each timing comes from the loop it names."""
    if trainer is None:
        return {"trainer_steps": None, "callbacks": []}
    names = [type(c).__name__ for c in trainer.callbacks if type(c).__name__ != "BatchClock"]
    return {"trainer_steps": trainer.global_step, "callbacks": names}


def plain_steps(model: Any, data: list, profile: cProfile.Profile | None = None) -> tuple[float, dict[str, Any]]:
    """Seconds per step of the plain loop (the first step, with lazy optimizer state, not counted), and what ran."""
    net = copy.deepcopy(model.net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    starts = []
    if profile:
        profile.enable()
    for x, y in data:
        starts.append(time.perf_counter())
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    starts.append(time.perf_counter())
    if profile:
        profile.disable()
    return (starts[-1] - starts[1]) / (len(starts) - 2), _ran()


def app_steps(
    model: Any, data: list, workdir: str, profile: cProfile.Profile | None = None
) -> tuple[float, dict[str, Any]]:
    """Seconds per step of the app: a new Trainer, its set-up outside the timed steps; and what ran."""
    from lightning.pytorch import Trainer

    from bench.common import batch_clock
    from bench.step_time import Batches

    clock = batch_clock("cpu")
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir,
        callbacks=[clock, *callbacks()],
    )  # fmt: skip
    if profile:
        profile.enable()
    trainer.fit(copy.deepcopy(model), train_dataloaders=Batches(data))
    if profile:
        profile.disable()
    return (clock.starts[-1] - clock.starts[1]) / (len(clock.starts) - 2), _ran(trainer)


def bare_steps(model: Any, data: list, workdir: str) -> tuple[float, dict[str, Any]]:
    """Seconds per step of Lightning alone: the same network in a minimal LightningModule (forward, loss, SGD; no
    logging, no metrics) and a Trainer without callbacks: what Lightning's loop costs before the app adds anything."""
    from lightning.pytorch import LightningModule, Trainer

    from bench.common import batch_clock
    from bench.step_time import Batches

    class Bare(LightningModule):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    clock = batch_clock("cpu")
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=workdir,
        callbacks=[clock],
    )  # fmt: skip
    trainer.fit(Bare(copy.deepcopy(model.net)), train_dataloaders=Batches(data))
    return (clock.starts[-1] - clock.starts[1]) / (len(clock.starts) - 2), _ran(trainer)


def breakdown(profile: cProfile.Profile, steps: int, loop: bool) -> dict[str, float]:
    """Milliseconds per step (under cProfile) per row; the app's callbacks each get a row. ``self.log`` (and
    ``log_dict``) is its own row: its time is taken out of the classifier's and the callbacks' rows that call it."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, own, cumulative, callers)

    def cumulative(suffix: str, name: str) -> float:
        return sum(v[3] for (f, _, n), v in stats.items() if n == name and f.endswith(suffix))

    logging = {k: v for k, v in stats.items() if k[0].endswith("lightning/pytorch/core/module.py") and k[2] in LOGS}

    def logging_from(file_part: str) -> float:
        """Time in self.log/log_dict called directly from functions of files containing ``file_part``."""
        return sum(
            times[3]
            for v in logging.values()
            for caller, times in v[4].items()
            if file_part in caller[0] and caller[2] not in LOGS
        )

    rows = {row: sum(cumulative(*key) for key in keys) * 1e3 / steps for row, keys in ROWS.items()}
    # Lightning runs forward and backward inside optimizer.step(closure): the step's own share is the rest
    rows["optimizer step"] -= cumulative("lightning/pytorch/loops/optimization/automatic.py", "__call__") * 1e3 / steps
    rows["classifier: training metrics"] -= logging_from("modules/classifier.py") * 1e3 / steps
    rows["self.log (Lightning's bookkeeping)"] = logging_from("/") * 1e3 / steps
    if not loop:
        total = sum(v[2] for v in stats.values()) * 1e3 / steps
        return {**rows, "rest (the loop's Python)": total - sum(rows.values()), "total": total}
    hooks: dict[str, float] = {}
    for (f, _, n), v in stats.items():
        if "/app/callbacks/" in f and n.startswith("on_"):
            name = f"callback {Path(f).stem}"
            hooks[name] = hooks.get(name, 0.0) + v[3] * 1e3 / steps
    for name in hooks:
        hooks[name] -= logging_from(f"/app/callbacks/{name.split()[-1]}.py") * 1e3 / steps
    total = cumulative(*LOOP) * 1e3 / steps
    rows |= dict(sorted(hooks.items(), key=lambda kv: -kv[1]))
    return {**rows, "Lightning's loop itself (the rest)": total - sum(rows.values()), "total": total}


def markdown(results: dict[str, Any]) -> str:
    s, wall = results["settings"], results["wall"]
    lines = [
        "# Where a short step's milliseconds go",
        "",
        f"Machine: {machine_line(results['machine'])}. Load average (1 min) before / after: "
        f"{results['load'][0]:.1f} / {results['load'][1]:.1f}. Command: `{s['command']}`",
        f"Settings: 1 process x 1 thread, mnist_cnn, batch {s['batch_size']}, {s['steps']} steps per run, "
        f"{s['rounds']} alternating rounds; the app with the default config's per-step callbacks, no logger.",
        "",
        f"Wall time per step (median over rounds): plain loop {wall['plain_ms']:.2f} ms; Lightning alone (a minimal "
        f"LightningModule, no callbacks) {wall['lightning_ms']:.2f} ms; the app {wall['app_ms']:.2f} ms. Ratios "
        f"(medians of the per-round ratios): Lightning alone / plain {wall['lightning_ratio']:.3f}, app / plain "
        f"{wall['ratio']:.3f}, app / Lightning alone {wall['app_over_lightning']:.3f}.",
        "",
        "Under cProfile (ms per step; every Python call is charged, so the figures are inflated: compare rows):",
        "",
        "| part of the step | plain loop | app |",
        "|---|---|---|",
    ]
    plain_rows, app_rows = results["profile"]["plain"], results["profile"]["app"]
    for row in dict.fromkeys([*app_rows, *plain_rows]):
        a, p = app_rows.get(row), plain_rows.get(row)
        lines.append(f"| {row} | {'-' if p is None else f'{p:.3f}'} | {'-' if a is None else f'{a:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=16, help="batch (default 16)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    import app.strategies  # noqa: F401  (registers the app's strategy names)
    from modules import ImageClassifier

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    command = "python -m bench.step_profile " + " ".join(argv if argv is not None else sys.argv[1:]).strip()
    load = [os.getloadavg()[0]]
    torch.manual_seed(0)
    model = ImageClassifier(arch="mnist_cnn", optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    data = batches(args.steps + 1, args.batch_size)
    with tempfile.TemporaryDirectory(prefix="step-profile-") as workdir:
        app_steps(model, data[:5], workdir)  # warm-up: imports, first-call costs
        runs = [
            (plain_steps(model, data), app_steps(model, data, workdir), bare_steps(model, data, workdir))
            for _ in range(args.rounds)
        ]
        rounds = [tuple(seconds for seconds, _ in run) for run in runs]
        ran = dict(zip(("plain", "app", "lightning"), (what for _, what in runs[0]), strict=True))
        profiles = {"plain": cProfile.Profile(), "app": cProfile.Profile()}
        plain_steps(model, data, profiles["plain"])
        app_steps(model, data, workdir, profiles["app"])
    wall = {
        "plain_ms": statistics.median(p for p, _, _ in rounds) * 1e3,
        "app_ms": statistics.median(a for _, a, _ in rounds) * 1e3,
        "lightning_ms": statistics.median(b for _, _, b in rounds) * 1e3,
        "ratio": statistics.median(a / p for p, a, _ in rounds),
        "lightning_ratio": statistics.median(b / p for p, _, b in rounds),
        "app_over_lightning": statistics.median(a / b for _, a, b in rounds),
    }
    profile = {kind: breakdown(p, args.steps, kind == "app") for kind, p in profiles.items()}
    settings = {"steps": args.steps, "rounds": args.rounds, "batch_size": args.batch_size, "command": command}
    load.append(os.getloadavg()[0])
    facts = {"wall": wall, "ran": ran, "profile": profile}
    results = report_results(args.out / "step_profile", settings, load, facts, markdown, lambda r: None)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
