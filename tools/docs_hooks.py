"""mkdocs hook (mkdocs.yml ``hooks:``): the site publishes ``bench/results/*.png`` at ``bench/results/``, so a page
shows the plots the benchmark scripts wrote next to their results files (``![..](bench/results/NAME.png)``), and
``docs/`` holds no copy that could fall behind."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files


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
