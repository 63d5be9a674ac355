"""mkdocs hooks (mkdocs.yml ``hooks:``).

- The site publishes ``bench/results/*.png`` at ``bench/results/``, so a page shows the plots the benchmark scripts
  wrote next to their results files (``![..](bench/results/NAME.png)``), and ``docs/`` holds no copy that could fall
  behind.
- A page's line ``<!-- cli-options -->`` becomes the options reference rendered from the CLI's own parser
  (:func:`tools.docs_reference.markdown`), so the reference is the parser of the code being built.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
CLI_OPTIONS = "<!-- cli-options -->"


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_OPTIONS not in markdown:
        return markdown
    return markdown.replace(CLI_OPTIONS, _cli_options())
