"""The parts of the docs site that the app renders cannot drift from the app.

- The options reference (``docs/reference/cli.md``, its ``<!-- cli-options -->`` line filled at build time by
  ``tools/docs_hooks.py``) names every option that ``python cli.py fit --help`` prints.
- The SLURM recipe's sbatch script (``docs/snippets/resnet50_2x4.sbatch``) is what ``python -m tools.slurm submit
  ... --dry-run`` prints today (``python -m tools.docs_snippets`` rewrites it).
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT, run_cli
from tools.docs_hooks import CLI_OPTIONS
from tools.docs_snippets import SNIPPETS, render


def help_options(text: str) -> set[str]:
    """Every option string of an argparse help text's option lines (``  --a.b X, --a.b+ X``), the usage excluded."""
    body = text.split("\noptions:\n", 1)[1]
    found = set()
    for line in body.splitlines():
        if re.match(r"^  -", line):
            found |= set(re.findall(r"(?:^|, )(--?[\w.+-]+)", line.strip()))
    return found


def test_the_reference_page_names_every_option_of_fit_help():
    assert CLI_OPTIONS in (ROOT / "docs" / "reference" / "cli.md").read_text()
    printed = run_cli("fit", "--help", timeout=120)
    assert printed.returncode == 0, printed.stderr
    options = help_options(printed.stdout)
    assert len(options) > 90, sorted(options)  # the trainer's, the model's, the data's, the app's own
    page = subprocess.run(
        [sys.executable, "-m", "tools.docs_reference"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    missing = sorted(option for option in options if f"`{option}`" not in page)
    assert not missing, f"cli.py fit --help has options the reference page lacks: {missing}"


def test_the_committed_sbatch_is_what_the_dry_run_prints_today():
    for path, (submit, command) in SNIPPETS.items():
        fresh = render(submit, command)
        assert "#SBATCH --requeue" in fresh and "--trainer.num_nodes 2 --trainer.devices 4" in fresh
        committed = (ROOT / path).read_text()
        assert committed == fresh, f"{path} differs from the dry run's output: run python -m tools.docs_snippets"
