"""Start-up: what the app adds to Lightning's own import, and where the time to the first training step goes.

``python -m bench.startup`` (about a minute on 2 CPU cores), each measurement ``--repeats`` times (median):

- the floors: ``python -c "import torch"`` and ``python -c "import lightning.pytorch"`` (Lightning imports torch,
  torchmetrics, and through torchmetrics torchvision and torch._dynamo);
- Lightning's import again as ``cli.py`` loads the app: the cyclic garbage collector off while the modules load, then
  what they left frozen (``core.loading.unwatched``);
- ``python cli.py fit --help``: Lightning's import plus the app's modules and the CLI parser built from the configs;
- ``python cli.py fit`` of the default recipe up to its first training step, split into: the interpreter's start,
  imports (``app.cli``), parsing the configs and building the classes (``main(run=False)``), the data set-up (MNIST
  read and held resident), the model set-up (optimizer, scheduler, the sanity check on 2 validation batches) and the
  first step. Each leg is timed inside a child process started for it (``--probe``), from the parent's clock; the
  same with Python's default collector beside it (runs alternating).

Writes ``results/startup.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# only the standard library here: the probe's child process measures its own imports (bench.common imports torch)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
AS_CLI = "from core.loading import unwatched\nwith unwatched(): import lightning.pytorch"  # as cli.py loads the app
FLOORS = {
    "python -c 'import torch'": ["-c", "import torch"],
    "python -c 'import lightning.pytorch'": ["-c", "import lightning.pytorch"],
    "python -c 'import lightning.pytorch', loaded as cli.py loads the app": ["-c", AS_CLI],
    "python cli.py fit --help": ["cli.py", "fit", "--help"],
}
COLLECTOR = {"cli": "as cli.py sets it", "default": "Python's default"}
LEGS = ["interpreter start", "imports (app.cli)", "parse configs, build classes", "data set-up", "model set-up and "
        "sanity check", "first training step"]  # fmt: skip


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def probe(spawned: float, root: str, collector: str) -> None:
    """In the child: the clock (``time.time()``) at each leg's end, printed as JSON on the last line. ``collector``:
    ``cli`` (the imports under ``core.loading.unwatched``, as ``cli.py`` loads the app) or ``default``."""
    import contextlib

    from core.loading import unwatched

    marks = {"interpreter start": time.time()}
    with unwatched() if collector == "cli" else contextlib.nullcontext():
        from lightning.pytorch import Callback

        from app.command import main
    marks["imports (app.cli)"] = time.time()

    class Marks(Callback):
        def setup(self, trainer, pl_module, stage):  # after the DataModule's setup
            marks.setdefault("data set-up", time.time())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks.setdefault("model set-up and sanity check", time.time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.setdefault("first training step", time.time())

    cli = main(["--trainer.default_root_dir", root, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "2",
                "--trainer.enable_progress_bar", "false"], run=False)  # fmt: skip
    marks["parse configs, build classes"] = time.time()
    cli.trainer.callbacks.append(Marks())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ends = [marks[leg] for leg in LEGS]
    print(json.dumps(dict(zip(LEGS, [b - a for a, b in zip([spawned, *ends], ends, strict=False)], strict=True))))


def split(collector: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="startup-") as root:
        spawned = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "bench.startup", "--probe", str(spawned), root, collector],
            cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(repeats: int) -> dict[str, Any]:
    from bench.common import machine

    floors = {name: [wall(args) for _ in range(repeats)] for name, args in FLOORS.items()}
    splits = {collector: [] for collector in COLLECTOR}
    for _ in range(repeats):  # alternating, so that a drift of the machine's speed touches both alike
        for collector, found in splits.items():
            found.append(split(collector))
    return {
        "machine": machine(),
        "repeats": repeats,
        "floors_s": {name: statistics.median(v) for name, v in floors.items()},
        "floors_all_s": floors,
        "split_s": {leg: statistics.median(s[leg] for s in splits["cli"]) for leg in LEGS},
        "split_default_gc_s": {leg: statistics.median(s[leg] for s in splits["default"]) for leg in LEGS},
        "splits_all_s": splits,
    }


def markdown(result: dict[str, Any]) -> str:
    from bench.common import machine_line

    floors, legs, default = result["floors_s"], result["split_s"], result["split_default_gc_s"]
    lightning = floors["python -c 'import lightning.pytorch', loaded as cli.py loads the app"]
    help_ = floors["python cli.py fit --help"]
    plain = floors["python -c 'import lightning.pytorch'"]
    lines = [
        "# Start-up: Lightning's floor, what the app adds, and the time to the first training step",
        "",
        f"Machine: {machine_line(result['machine'])}. Command: `python -m bench.startup` (median of "
        f"{result['repeats']} runs of each).",
        "",
        "| command | wall time (s) |",
        "|---|---|",
        *(f"| `{name}` | {seconds:.2f} |" for name, seconds in floors.items()),
        "",
        f"With the collector as `cli.py` sets it, Lightning's import from the process start to its exit takes "
        f"{lightning / plain:.2f}x the time (the collection Python makes "
        "as it exits walks nothing frozen).",
        "",
        f"The app adds {help_ - lightning:.2f} s to `import lightning.pytorch` (with the collector as `cli.py` sets "
        "it) in `cli.py fit --help` (its own modules and the CLI parser built from the configs); torch's and "
        "Lightning's imports are the floor.",
        "",
        "`python cli.py fit` (the default recipe), from the process start to the end of its first training step, with "
        "the cyclic garbage collector as `cli.py` sets it (off while the modules load, then what they left frozen) "
        "and with Python's default:",
        "",
        f"| leg | seconds, collector {COLLECTOR['cli']} | seconds, collector {COLLECTOR['default']} |",
        "|---|---|---|",
        *(f"| {leg} | {seconds:.2f} | {default[leg]:.2f} |" for leg, seconds in legs.items()),
        f"| **total** | **{sum(legs.values()):.2f}** | **{sum(default.values()):.2f}** |",
        "",
        f"The collector as `cli.py` sets it: {sum(legs.values()) / sum(default.values()):.2f}x the time to the first "
        "step with Python's default.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.common import figure

    floors = result["floors_s"]
    rows = {"cli.py fit to its\nfirst step": result["split_s"],
            "the same, Python's\ndefault collector": result["split_default_gc_s"]}  # fmt: skip
    with figure(path, figsize=(7.0, 3.8)) as (_, ax):
        floor = floors["python -c 'import lightning.pytorch'"]
        ax.barh(["python -c 'import\nlightning.pytorch'\n(start to exit)"], [floor], color="tab:grey")
        for row, legs in reversed(rows.items()):
            left = 0.0
            for n, (leg, seconds) in enumerate(legs.items()):
                ax.barh([row], [seconds], left=left, color=f"C{n}", label=leg if row.startswith("cli.py") else None)
                left += seconds
        ax.set_xlabel("seconds from the process start")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
        ax.set_title("Start-up of the default MNIST run (2-core CPU)")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for startup.{json,md}")
    parser.add_argument("--probe", nargs=3, metavar=("SPAWNED", "ROOT", "COLLECTOR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        probe(float(args.probe[0]), args.probe[1], args.probe[2])
        return None
    from bench.common import save

    result = run(args.repeats)
    save(args.out, "startup", result, markdown, plot)
    return result


if __name__ == "__main__":
    main()
