"""The troubleshooting page's quotes, as the tests that trigger each message assert them.

``docs/troubleshooting.md`` has one ``### `` section per error message, under ``## `` groups by symptom; a section
quotes its message in a ``text`` block, where ``<...>`` stands for a part that differs per run (a path, a number) and
``…`` for a cut long list.
:func:`assert_documented` is how a test checks a line the app printed: it must end with the link to its section and
match that section's quote. ``tests/unit/test_troubleshooting_docs.py`` requires every quote to be asserted by some
test, so a quote cannot drift from what the app prints.
"""

from __future__ import annotations

import re
from functools import cache

from core.errors import DOCS_URL
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "troubleshooting.md"


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading of plain words: lower case, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def quotes() -> dict[str, list[str]]:
    """Each section's anchor -> the lines its ``text`` blocks quote (in page order)."""
    found: dict[str, list[str]] = {}
    anchor = None
    for block in re.split(r"(?m)^(#{1,3} .*)$", PAGE.read_text()):
        if block.startswith("### "):
            anchor = slug(block[4:])
            found[anchor] = []
        elif block.startswith("#"):  # the page's title, a group by symptom: no section of its own
            anchor = None
        elif anchor is not None:
            for body in re.findall(r"```text\n(.*?)```", block, flags=re.S):
                found[anchor] += [line for line in body.splitlines() if line.strip()]
    return found


def pattern(quote: str) -> re.Pattern:
    """The regex of a quoted line: ``<...>`` and ``…`` match any text (none too), the rest itself."""
    parts = re.split(r"(<[^<>]*>|…)", quote.strip())
    return re.compile("".join(".*?" if p == "…" or re.fullmatch(r"<[^<>]*>", p) else re.escape(p) for p in parts))


def assert_documented(output: str, anchor: str, ranks: int = 1) -> str:
    """The one line of ``output`` linked to ``anchor``'s section (``ranks`` times: once per rank that printed it),
    which must match a quote of that section; returns it."""
    link = f" Help: {DOCS_URL}#{anchor}"
    lines = [line.strip() for line in output.splitlines() if line.endswith(link)]
    assert len(lines) == ranks, f"expected {ranks} line(s) ending with{link}, got {lines}\n{output[-3000:]}"
    said = quotes().get(anchor)
    assert said, f"docs/troubleshooting.md has no quote in a section '{anchor}'"
    for line in lines:
        text = line[: -len(link)]
        assert any(pattern(q).fullmatch(text) for q in said), f"{text!r} matches none of the quotes {said}"
    return lines[0]
