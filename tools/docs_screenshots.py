"""Screenshots of the built docs site with headless Chromium, to look at what the pages render.

Serves ``--site`` (what ``mkdocs build`` wrote) on 127.0.0.1 and saves one PNG per page of ``mkdocs.yml``'s nav, plus
one per section listed in ``SECTIONS`` (tables, code blocks, admonitions further down a page), into ``--out``.
Written by hand because the only browser at hand is Debian's ``chromium`` binary: its ``--screenshot`` flag takes
one viewport per call, and a URL fragment scrolls that viewport to the section.

Usage: ``python tools/docs_screenshots.py --site site --out docs-screenshots`` (``make docs-screenshots``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# Sections below the first screen of their page, worth a screenshot of their own: page, anchor ("" = the top), window
# height (a tall window shows a whole long table in one picture).
SECTIONS = [
    ("parallel-modes.md", "allreduce", 1600),
    ("parallel-modes.md", "measured-parity", 1600),
    ("precision.md", "training-health", 1600),
    ("migrating.md", "", 4000),
    ("multi-node.md", "example-a-rendered-script", 1600),
    ("benchmarks.md", "step-time-the-modes-against-plain-pytorch", 1600),
    ("architecture.md", "where-a-change-goes", 1600),
    ("data.md", "jpeg-decoding", 1600),
]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def nav_pages(nav: list) -> list[str]:
    """The Markdown files of an mkdocs nav, in order."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def url_of(page: str) -> str:
    """The built URL path of a page (mkdocs' directory URLs: ``a.md`` -> ``a/``, ``index.md`` -> ``/``)."""
    return "" if page == "index.md" else page.removesuffix(".md") + "/"


def serve(site: Path) -> ThreadingHTTPServer:
    """An HTTP server for ``site`` on a free port of 127.0.0.1, answering from a daemon thread."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]  (one line per request otherwise)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def screenshot(chromium: str, url: str, png: Path, size: str, profile: Path) -> None:
    """One viewport of ``url`` into ``png``; raises when Chromium fails or writes nothing."""
    png.unlink(missing_ok=True)
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
    command += ["--virtual-time-budget=3000", f"--screenshot={png}", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium failed on {url} (exit {done.returncode}): {done.stderr.strip()[-500:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (mkdocs build)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs-screenshots", help="folder for the PNGs")
    parser.add_argument("--size", default="1280,1600", help="window width,height in CSS pixels")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print(
            "error: no chromium on the PATH. Fix: apt-get install -y chromium (Debian), then run again.",
            file=sys.stderr,
        )
        return 1
    if not (args.site / "index.html").exists():
        print(
            f"error: {args.site}/index.html is missing. Fix: make docs (mkdocs build --strict) first.", file=sys.stderr
        )
        return 1
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    args.out.mkdir(parents=True, exist_ok=True)
    server = serve(args.site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    height = int(args.size.split(",")[1])
    shots = [(page, "", height) for page in pages] + SECTIONS
    try:
        with tempfile.TemporaryDirectory(prefix="docs-shots-") as profile:
            for n, (page, anchor, tall) in enumerate(shots):
                png = args.out / f"{n:02d}-{page.removesuffix('.md')}{f'--{anchor}' if anchor else ''}.png"
                url = base + url_of(page) + (f"#{anchor}" if anchor else "")
                screenshot(chromium, url, png, f"{args.size.split(',')[0]},{tall}", Path(profile))
                print(png)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
