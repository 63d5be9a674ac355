"""The commands the docs tell a user to run do run: every ```` ```bash ```` block right after a ``<!-- runnable -->``
line of a page under ``docs/`` is run as it is written, so a recipe cannot rot.

Each block runs with ``bash -e`` in a temporary folder of its own that looks like a fresh checkout: the checkout's
files are linked in (``cli.py``, ``configs/``, the packages, ``.venv`` -> this interpreter's environment), ``data/``
holds the real MNIST files, and whatever the block writes (``runs/``, shards, a config) stays in that folder. A
non-zero exit, a process that aborted as it ended ("terminate called"), or a ``cli.py fit`` without its training
summary fails with the block's page and line, the command and the end of its output. The blocks are CPU-sized
variants (a few batches, ``--dry-run``) that run in seconds; ``docs/development.md`` ("The docs") says how to mark
one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.xdist_group("docs"), pytest.mark.slow]

DOCS = ROOT / "docs"
MARK = "<!-- runnable -->"
# the checkout's entries a block may not see as they are: what runs write, caches, the data (linked on its own)
NOT_LINKED = {".git", ".venv", "data", "runs", "site", "wandb", "lightning_logs", "docs-screenshots", ".pytest_cache"}
# pages a user reads to do something, each of which has a runnable block (the GPU check's CPU rehearsal takes minutes)
WITHOUT_RUNNABLE = {"how-to/gpu-check.md"}
# variables that would make a block's cli.py believe it runs under a launcher, or reach W&B's servers
FIT = re.compile(r"cli\.py fit\b(?![^\n]*--print_config)")  # a command that trains (a line of a block)
LAUNCHER_VARS = re.compile(
    r"^(SLURM_|TORCHELASTIC_|MASTER_(ADDR|PORT)$|(LOCAL_|GROUP_)?RANK$|(LOCAL_)?WORLD_SIZE$|NODE_RANK$|WANDB_)"
)


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int  # of the opening fence
    code: str

    def __str__(self) -> str:
        return f"docs/{self.page}:{self.line}"


def runnable_blocks(docs: Path = DOCS) -> list[Block]:
    """Every ```` ```bash ```` block whose previous non-blank line is the mark, in page order."""
    blocks = []
    for path in sorted(docs.rglob("*.md")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            j = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), None)
            assert j is not None and lines[j].strip() == "```bash", (
                f"{path.relative_to(ROOT)}:{i + 1}: {MARK} must be followed by a ```bash block"
            )
            end = next(k for k in range(j + 1, len(lines)) if lines[k].strip() == "```")
            blocks.append(Block(path.relative_to(docs).as_posix(), j + 1, "\n".join(lines[j + 1 : end]) + "\n"))
    return blocks


BLOCKS = runnable_blocks()
# a block that two pages show word for word (a tutorial step that is also a how-to's) runs once, named by both
SAME = {code: [b for b in BLOCKS if b.code == code] for code in dict.fromkeys(b.code for b in BLOCKS)}


def test_every_tutorial_and_how_to_page_has_a_runnable_block():
    pages = {p.relative_to(DOCS).as_posix() for d in ("tutorial", "how-to") for p in (DOCS / d).glob("*.md")}
    with_block = {b.page for b in BLOCKS}
    missing = sorted(pages - with_block - WITHOUT_RUNNABLE)
    assert not missing, f"pages with no {MARK} block: {missing}"
    assert len(BLOCKS) >= len(pages) - len(WITHOUT_RUNNABLE)


@pytest.fixture
def checkout(tmp_path: Path, mnist_dir: Path) -> Path:
    """A folder that looks like a checkout with ``make demo``'s set-up done, writing nowhere but into itself."""
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED:
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "data").symlink_to(mnist_dir.resolve(), target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("shown", list(SAME.values()), ids=lambda shown: " ".join(map(str, shown)))
def test_the_block_runs(shown: list[Block], checkout: Path):
    block = shown[0]
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update(PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = done.stdout + done.stderr
    # a process that aborted while Python finalized (libstdc++ says "terminate called"): under Lightning's launcher
    # rank 1 is rank 0's child, whose status reaches nobody, so its output is the witness (tests/distributed/
    # test_clean_exit.py); the blocks include 2-process jobs under Lightning's launcher, torchrun and the old launcher
    aborted = "terminate called" in said or "SIGABRT" in said
    # and each fit trained: rank 0 of every `cli.py fit` ends with its training summary (--print_config trains nothing)
    fits = len(FIT.findall(block.code.replace("\\\n", " ")))
    summaries = said.count("Training summary")
    if done.returncode != 0 or aborted or summaries != fits:
        where = ", ".join(map(str, shown))
        what = f"exit status {done.returncode}" + (", a process aborted at its exit" if aborted else "")
        what += f", {summaries} training summaries for {fits} fits" if summaries != fits else ""
        pytest.fail(f"{where}: {what}\n{block.code}\n--- the end of its output ---\n{said[-4000:]}")
