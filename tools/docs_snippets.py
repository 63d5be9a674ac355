"""Files the docs include that the app or a results file renders, so that a page shows what is true today.

``python -m tools.docs_snippets`` rewrites them; ``tests/unit/test_docs_generated.py`` renders them afresh and fails
when a committed file differs. The checkout's folder is written as ``/home/ada/dptrain`` (a user's checkout), so the
file does not depend on where it was rendered.

- ``docs/snippets/resnet50_2x8.sbatch``: the SLURM recipe's script, what ``python -m tools.slurm submit SUBMIT
  --dry-run -- COMMAND`` prints (:data:`SUBMIT`, :data:`COMMAND`: the page shows the same command).
- ``docs/snippets/resnet50_epoch.md``: ImageNet's time per epoch on each GPU kind measured, from the ResNet-50
  images/s of ``bench/results/gpu_*.json`` (``python -m bench.gpu``) in the recipe's precision and memory format,
  with the date, commit, torch and GPU of the measurement (``tests/unit/test_docs.py`` requires them by every GPU
  figure).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = "/home/ada/dptrain"  # how the pages name the user's checkout
IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC2012's training set
# The code each GPU results file was measured with, where the file records no commit of its own: `make gpu-check`
# ran on 2026-12-04 11:15-11:19 UTC at 7458fc7 (its call A failed twice; the fixes are c971793, the results 78aa04f).
MEASURED_AT = {"gpu_2026-12-04_NVIDIA-H200.json": "7458fc7"}

SUBMIT = [
    "--nodes", "2", "--gpus-per-node", "8", "--time", "24:00:00", "--partition", "gpu", "--sbatch", "mem=200G",
    "--setup", "module load cuda", "--setup", "export WANDB_MODE=offline", "--dry-run",
]  # fmt: skip
COMMAND = [
    "fit", "--config", "configs/imagenet.yaml", "--config", "configs/precision/bf16_mixed.yaml",
    "--config", "configs/logger/wandb.yaml", "--model.channels_last", "true", "--data.data_dir", "/data/imagenet",
    "--launch.max_restarts", "3",
]  # fmt: skip
RECIPE_CONFIG = "bf16 channels_last"  # bench.gpu's configuration of COMMAND's precision and memory format


def render(submit: list[str], command: list[str]) -> str:
    """What ``python -m tools.slurm submit SUBMIT -- COMMAND`` prints, run from the checkout's root with its venv's
    interpreter named on the nodes, the checkout's folder written as :data:`CHECKOUT`."""
    python = str(ROOT / ".venv" / "bin" / "python")
    argv = [sys.executable, "-m", "tools.slurm", "submit", *submit, "--python", python, "--", *command]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    return out.replace(str(ROOT), CHECKOUT).rstrip("\n") + "\n"


def epoch_table(results: Path = ROOT / "bench" / "results") -> str:
    """One row per GPU kind measured: ResNet-50 images/s on one GPU, the ImageNet epoch at that rate, and when, at
    which commit, with which torch it was measured."""
    rows = [
        "| GPU | ResNet-50 images/s | an ImageNet epoch on 1 GPU at that rate | measured (date, commit, torch, GPU) |",
        "|---|---|---|---|",
    ]
    for path in sorted(p for p in results.glob("gpu_*_*.json") if "_smoke" not in p.name):
        run = json.loads(path.read_text())
        row = next((r for r in run["throughput"] if r["config"] == RECIPE_CONFIG), None)
        if row is None:
            continue
        machine, settings = run["machine"], run["settings"]
        commit = machine.get("commit") or MEASURED_AT[path.name]
        rows.append(
            f"| {machine['gpu']} | {row['img_per_s']:,.0f} | {IMAGENET_TRAIN_IMAGES / row['img_per_s'] / 60:.1f} min | "
            f"({machine['date'][:10]}, commit {commit[:7]}, torch {machine['torch']}, {machine['gpu']}) "
            f"{RECIPE_CONFIG}, a synthetic batch of {settings['batch_size']} on the GPU: `bench/results/{path.name}` |"
        )
    return "\n".join(rows) + "\n"


SNIPPETS: dict[str, Callable[[], str]] = {
    "docs/snippets/resnet50_2x8.sbatch": lambda: render(SUBMIT, COMMAND),
    "docs/snippets/resnet50_epoch.md": epoch_table,
}


def main() -> None:
    for path, make in SNIPPETS.items():
        (ROOT / path).write_text(make())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
