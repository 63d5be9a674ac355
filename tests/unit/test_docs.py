"""The README stays a first screen and the docs site has no page a reader cannot reach.

`mkdocs build --strict` (in `.ci/run` and `make docs`) checks links and anchors; these checks need no mkdocs and run
in the fast tier, so a page added without its nav entry, or a README grown back, fails before CI does.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tools.docs_screenshots import nav_pages  # the same reading of the nav as the screenshots'

ROOT = Path(__file__).resolve().parents[2]


def test_readme_is_a_first_screen_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail into a page under docs/"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = nav_pages(config["nav"])
    on_disk = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(set(in_nav)) == on_disk, "docs/ pages and mkdocs.yml's nav differ"
    assert len(in_nav) == len(set(in_nav)), "a page is twice in the nav"


def test_the_readme_links_only_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t}
    missing = sorted(t for t in targets if t and not (ROOT / t).exists())
    assert not missing, f"README.md links to missing files: {missing}"
