"""mkdocs hooks (mkdocs.yml ``hooks:``).

- The site publishes ``bench/results/*.png`` at ``bench/results/``, so a page shows the plots the benchmark scripts
  wrote next to their results files (``![..](bench/results/NAME.png)``), and ``docs/`` holds no copy that could fall
  behind.
- A results file included with ``--8<-- "bench/results/NAME.md:2:"`` keeps its numbers, but its headings become bold
  lines: the benchmark scripts head each table (``## cnn 32-true``), and seven such headings in the sidebar said
  nothing. The file is inlined here, before pymdownx.snippets sees the page; other includes are left to it.
- A page's line ``<!-- cli-options -->`` becomes the options reference rendered from the CLI's own parser
  (:func:`tools.docs_reference.markdown`), so the reference is the parser of the code being built.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
CLI_OPTIONS = "<!-- cli-options -->"
INCLUDE = re.compile(
    r'^(?P<indent>[ \t]*)--8<-- "(?P<path>bench/results/[^":]+\.md)(?::(?P<start>\d*))?(?::(?P<end>\d*))?"[ \t]*$', re.M
)
HEADING = re.compile(r"^#{1,6} +(.*?)[ #]*$")


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).parent
    for png in sorted((root / "bench" / "results").glob("*.png")):
        files.append(
            File(
                f"bench/results/{png.name}",
                src_dir=str(root),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


@cache
def _cli_options() -> str:
    if str(ROOT) not in sys.path:  # mkdocs runs from .venv/bin: the checkout's packages are not importable yet
        sys.path.insert(0, str(ROOT))
    from tools.docs_reference import markdown

    return markdown()


def _results_without_headings(match: re.Match) -> str:
    """The included lines of a results file, its headings as bold lines; a file that is missing or has no heading in
    those lines is left to pymdownx.snippets (which fails the build for a missing one)."""
    path = ROOT / match["path"]
    if not path.is_file():
        return match[0]
    lines = path.read_text().splitlines()
    start, end = int(match["start"] or 1), int(match["end"] or len(lines))
    lines = lines[start - 1 : end]
    if not any(HEADING.match(line) for line in lines):
        return match[0]
    bold = [f"**{HEADING.match(line)[1]}**" if HEADING.match(line) else line for line in lines]
    return "\n".join(match["indent"] + line if line else "" for line in bold)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = INCLUDE.sub(_results_without_headings, markdown)
    if CLI_OPTIONS in markdown:
        markdown = markdown.replace(CLI_OPTIONS, _cli_options())
    return markdown
