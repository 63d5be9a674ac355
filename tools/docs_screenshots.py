"""Screenshots of the built docs site with headless Chromium, to look at what the pages render.

Serves ``--site`` (what ``mkdocs build`` wrote) on 127.0.0.1, takes one tall screenshot of every page of
``mkdocs.yml``'s nav, cuts off the blank space above the footer and saves the page as tiles of ``--tile`` pixels
(``NN-page-K.png``) into ``--out``, each small enough to view whole. Written by hand because the only browser at hand
is Debian's ``chromium`` binary: its ``--screenshot`` flag takes one window per call, and a URL fragment does not
reliably scroll that window before the capture (the sections came out blank).

Usage: ``python tools/docs_screenshots.py --site site --out docs-screenshots`` (``make docs-screenshots``); a phone:
``--width 420``; a few pages: ``--pages index.md,troubleshooting.md``.
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

import numpy as np
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
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


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (the base's name)
        """No line per request (the base prints one to stderr for every asset)."""


def serve(site: Path) -> ThreadingHTTPServer:
    """An HTTP server for ``site`` on a free port of 127.0.0.1, answering from a daemon thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def screenshot(chromium: str, url: str, png: Path, width: int, height: int, profile: Path) -> None:
    """One window of ``url`` into ``png``; raises when Chromium fails or writes nothing."""
    png.unlink(missing_ok=True)
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
    command += ["--virtual-time-budget=3000", f"--screenshot={png}", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium failed on {url} (exit {done.returncode}): {done.stderr.strip()[-500:]}")


def footer_top(gray: np.ndarray) -> int:
    """The first row of the footer: the dark band (Material's footer is dark grey) at the bottom of the window."""
    dark = gray.mean(axis=1) < 100
    top = len(dark)
    while top > 0 and dark[top - 1]:
        top -= 1
    return top


def tiles(png: Path, tile: int) -> list[Path]:
    """Cuts a tall screenshot into tiles of ``tile`` rows, the blank space above the footer dropped and the footer
    joined to the last tile, so that the page's end is seen. Warns when the page fills the whole window."""
    image = Image.open(png).convert("RGB")
    gray = np.asarray(image.convert("L"))
    footer_at = footer_top(gray)
    inked = np.nonzero((gray[:footer_at] < 245).any(axis=1))[0]
    end = min(int(inked.max()) + 40, footer_at) if len(inked) else footer_at
    if end >= footer_at:
        print(f"warning: {png.name} fills the whole window; raise --height to see its end", file=sys.stderr)
    footer = image.crop((0, footer_at, image.width, image.height))
    tops = list(range(0, end, tile))
    if len(tops) > 1 and end - tops[-1] < tile // 6:  # a sliver of a last tile: the one before it takes it
        tops.pop()
    out = []
    for k, top in enumerate(tops):
        last = k == len(tops) - 1
        piece = image.crop((0, top, image.width, end if last else top + tile))
        if last:
            joined = Image.new("RGB", (piece.width, piece.height + footer.height), "white")
            joined.paste(piece, (0, 0))
            joined.paste(footer, (0, piece.height))
            piece = joined
        path = png.with_name(f"{png.stem}-{k}.png")
        piece.save(path)
        out.append(path)
    png.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (mkdocs build)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs-screenshots", help="folder for the PNGs")
    parser.add_argument("--width", type=int, default=1280, help="window width in CSS pixels")
    parser.add_argument("--height", type=int, default=16000, help="window height: more than the longest page")
    parser.add_argument("--tile", type=int, default=1800, help="rows per saved tile")
    parser.add_argument("--pages", default=None, help="only these pages of the nav, comma-separated: index.md,...")
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
    if args.pages:
        unknown = sorted(set(args.pages.split(",")) - set(pages))
        if unknown:
            print(f"error: --pages {', '.join(unknown)}: not in mkdocs.yml's nav", file=sys.stderr)
            return 1
        pages = [page for page in pages if page in args.pages.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.png"):
        old.unlink()
    server = serve(args.site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with tempfile.TemporaryDirectory(prefix="docs-shots-") as profile:
            for n, page in enumerate(pages):
                png = args.out / f"{n:02d}-{page.removesuffix('.md').replace('/', '-')}.png"  # how-to/x.md: one file
                screenshot(chromium, base + url_of(page), png, args.width, args.height, Path(profile))
                for path in tiles(png, args.tile):
                    print(path)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
