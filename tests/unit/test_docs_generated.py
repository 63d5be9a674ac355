"""The parts of the docs site that the app renders cannot drift from the app.

- The options reference (``docs/reference/cli.md``, its ``<!-- cli-options -->`` line filled at build time by
  ``tools/docs_hooks.py``) names every option that ``python cli.py fit --help`` prints.
- The SLURM recipe's sbatch script (``docs/snippets/resnet50_2x8.sbatch``) is what ``python -m tools.slurm submit
  ... --dry-run`` prints today, and its page shows that command; the time per ImageNet epoch
  (``docs/snippets/resnet50_epoch.md``) is computed from the committed GPU results (``python -m tools.docs_snippets``
  rewrites both).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli
from tools.docs_hooks import CLI_OPTIONS
from tools.docs_snippets import COMMAND, SNIPPETS, SUBMIT


def help_options(text: str) -> set[str]:
    """Every option string of an argparse help text's option lines (``  --a.b X, --a.b+ X``), the usage excluded."""
    body = text.split("\noptions:\n", 1)[1]
    found = set()
    for line in body.splitlines():
        if re.match(r"^  -", line):
            found |= set(re.findall(r"(?:^|, )(--?[\w.+-]+)", line.strip()))
    return found


@pytest.fixture(scope="module")
def fit_help() -> str:
    """What ``python cli.py fit --help`` prints (one process for the module's tests)."""
    printed = run_cli("fit", "--help", timeout=120)
    assert printed.returncode == 0, printed.stderr
    return printed.stdout


def test_the_reference_page_names_every_option_of_fit_help(fit_help):
    assert CLI_OPTIONS in (ROOT / "docs" / "reference" / "cli.md").read_text()
    options = help_options(fit_help)
    assert len(options) > 90, sorted(options)  # the trainer's, the model's, the data's, the app's own
    page = subprocess.run(
        [sys.executable, "-m", "tools.docs_reference"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    missing = sorted(option for option in options if f"`{option}`" not in page)
    assert not missing, f"cli.py fit --help has options the reference page lacks: {missing}"


def test_the_committed_snippets_are_what_the_app_and_the_results_render_today():
    for path, make in SNIPPETS.items():
        committed = (ROOT / path).read_text()
        assert committed == make(), f"{path} differs from what it renders today: run python -m tools.docs_snippets"
    sbatch = (ROOT / "docs" / "snippets" / "resnet50_2x8.sbatch").read_text()
    assert "#SBATCH --requeue" in sbatch and "--trainer.num_nodes 2 --trainer.devices 8" in sbatch
    assert "#SBATCH --mem=200G" in sbatch and "export WANDB_MODE=offline" in sbatch
    assert "--launch.max_restarts 3" in sbatch and "scontrol requeue" in sbatch  # a fault requeues the job
    assert "| NVIDIA H200 | 4,564 |" in (ROOT / "docs" / "snippets" / "resnet50_epoch.md").read_text()


def test_the_slurm_page_shows_the_command_that_renders_its_script():
    """The how-to's runnable dry run is the command :data:`tools.docs_snippets.SUBMIT` / ``COMMAND`` render, so the
    script shown below it is the one that command prints; its first block (submit) is the same without --dry-run."""
    page = (ROOT / "docs" / "how-to" / "slurm-resnet50.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    blocks = [shlex.split(b.replace("\\\n", " ")) for b in blocks if "tools.slurm" in b]
    expected = [".venv/bin/python", "-m", "tools.slurm", "submit", *SUBMIT, "--", *COMMAND]
    assert expected in blocks
    assert [a for a in expected if a != "--dry-run"] in blocks


def test_the_max_restarts_help_names_the_launchers_of_the_launching_table(fit_help):
    """``--launch.max_restarts``'s help and the table "What heals, on which launcher" say where the budget applies:
    each launcher a column names is in the help (it once said the option was for runs started without SLURM)."""
    page = (ROOT / "docs" / "reference" / "launching.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| fault |"))
    option = fit_help.split("\n  --launch.max_restarts MAX_RESTARTS", 1)[1].split("\n  --launch.debug")[0]
    help_text = " ".join(option.split())
    for column, said in {
        "Lightning's launcher": "Lightning's launcher",
        "torchrun --max-restarts": "torchrun's --max-restarts",
        "tools.slurm submit": "tools.slurm submit",
        "#SBATCH --requeue": "#SBATCH --requeue",
    }.items():
        assert column in header and said in help_text, (column, help_text)
