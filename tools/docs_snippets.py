"""Files the docs include that the app itself renders, so that a page shows what the app prints today.

``python -m tools.docs_snippets`` rewrites them; ``tests/unit/test_docs_generated.py`` renders them afresh and fails
when a committed file differs. The checkout's folder is written as ``/home/ada/dptrain`` (a user's checkout), so the
file does not depend on where it was rendered.

- ``docs/snippets/resnet50_2x4.sbatch``: the SLURM recipe's script, from

      python -m tools.slurm submit --nodes 2 --gpus-per-node 4 --time 24:00:00 --partition gpu \\
          --setup "module load cuda" --dry-run -- fit --config configs/imagenet.yaml \\
          --config configs/precision/bf16_mixed.yaml --model.arch resnet50 --data.data_dir /data/imagenet
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = "/home/ada/dptrain"  # how the pages name the user's checkout

SUBMIT = [
    "--nodes", "2", "--gpus-per-node", "4", "--time", "24:00:00", "--partition", "gpu",
    "--setup", "module load cuda", "--dry-run",
]  # fmt: skip
COMMAND = [
    "fit", "--config", "configs/imagenet.yaml", "--config", "configs/precision/bf16_mixed.yaml",
    "--model.arch", "resnet50", "--data.data_dir", "/data/imagenet",
]  # fmt: skip
SNIPPETS = {"docs/snippets/resnet50_2x4.sbatch": (SUBMIT, COMMAND)}


def render(submit: list[str], command: list[str]) -> str:
    """What ``python -m tools.slurm submit SUBMIT -- COMMAND`` prints, run from the checkout's root with its venv's
    interpreter named on the nodes, the checkout's folder written as :data:`CHECKOUT`."""
    python = str(ROOT / ".venv" / "bin" / "python")
    argv = [sys.executable, "-m", "tools.slurm", "submit", *submit, "--python", python, "--", *command]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    return out.replace(str(ROOT), CHECKOUT).rstrip("\n") + "\n"


def main() -> None:
    for path, (submit, command) in SNIPPETS.items():
        (ROOT / path).write_text(render(submit, command))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
