"""docs/troubleshooting.md cannot drift from the app: each section is one of ``core.errors.SECTIONS`` (the links the
error lines end with), each quotes its message, each quote routes back to its own section, and each section's quote
is asserted by a test that makes the mistake (``tests.troubleshooting.assert_documented``)."""

from __future__ import annotations

import ast

from core.errors import SECTIONS, docs_anchor
from tests.conftest import ROOT
from tests.troubleshooting import quotes, slug


def asserted_anchors() -> dict[str, list[str]]:
    """anchor -> the test modules that name it: a string equal to the anchor (an argument of ``assert_documented``
    or of a helper that calls it, an entry of a parametrize table; not a docstring) in a module that calls it."""
    anchors = {anchor for anchor, _ in SECTIONS}
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        calls = {
            getattr(n.func, "id", getattr(n.func, "attr", None)) for n in ast.walk(tree) if isinstance(n, ast.Call)
        }
        if "assert_documented" not in calls:
            continue
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in anchors and id(node) not in docstrings:
                found.setdefault(node.value, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_section_is_a_link_target_and_every_link_has_a_section():
    sections = list(quotes())
    assert len(sections) == len(set(sections)), "two sections with the same heading"
    anchors = [anchor for anchor, _ in SECTIONS]
    assert sorted(sections) == sorted(anchors)
    assert all(slug(a.replace("-", " ")) == a for a in anchors)  # plain words: the same slug on GitHub and mkdocs


def test_every_quote_routes_back_to_its_own_section():
    for anchor, lines in quotes().items():
        assert lines, f"section {anchor} quotes no message"
        for line in lines:
            assert line.startswith(("error: ", "- ")), line
            assert docs_anchor(line) == anchor, f"{line!r} would link to {docs_anchor(line)}, not {anchor}"


def test_every_quoted_section_is_asserted_by_a_test_that_makes_the_mistake():
    asserted = asserted_anchors()
    missing = [anchor for anchor in quotes() if anchor not in asserted]
    assert not missing, f"quoted, but no test asserts them: {missing}"
    unknown = [anchor for anchor in asserted if anchor not in quotes()]
    assert not unknown, f"tests assert sections the page does not have: {unknown}"
