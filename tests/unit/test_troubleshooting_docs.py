"""docs/troubleshooting.md cannot drift from the app: every help anchor the code gives where it raises an error has its
section, every section is an anchor the code gives, each section quotes its message, and each quote is asserted by a
test that makes the mistake (``tests.troubleshooting.assert_documented``: the printed line ends with that section's
link and matches its quote)."""

from __future__ import annotations

import ast

from tests.conftest import ROOT
from tests.troubleshooting import quotes, slug

CODE = ("core", "app", "datamodules", "modules", "tools")


def anchors_in_code() -> dict[str, list[str]]:
    """anchor -> where the code gives it: ``with_link(line, "anchor")``, ``SomeError(..., help="anchor")`` and a
    class's default ``help = "anchor"`` (an error class whose every error has the same section); an anchor chosen by a
    condition counts each literal it may be."""
    found: dict[str, list[str]] = {}
    for package in CODE:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                given = []
                if isinstance(node, ast.Call):
                    if getattr(node.func, "id", None) == "with_link" and len(node.args) == 2:
                        given.append(node.args[1])
                    name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                    if name.endswith("Error"):  # an error's constructor (an argparse help= is no anchor)
                        given += [k.value for k in node.keywords if k.arg == "help"]
                elif isinstance(node, ast.ClassDef):
                    given += [
                        n.value for n in node.body
                        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "help" for t in n.targets)
                    ]  # fmt: skip
                for leaf in (leaf for value in given for leaf in ast.walk(value)):  # also `"a" if ... else None`
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        found.setdefault(leaf.value, []).append(f"{where}:{leaf.lineno}")
    return found


def asserted_anchors() -> dict[str, list[str]]:
    """anchor -> the test modules that name it: a string equal to the anchor (an argument of ``assert_documented``
    or of a helper that calls it, an entry of a parametrize table; not a docstring) in a module that calls it."""
    anchors = set(quotes())
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


def test_every_anchor_the_code_gives_has_its_section_and_every_section_is_one():
    sections = list(quotes())
    assert len(sections) == len(set(sections)), "two sections with the same heading"
    given = anchors_in_code()
    without_section = {a: where for a, where in given.items() if a not in sections}
    assert not without_section, f"the code links to sections the page does not have: {without_section}"
    never_given = [a for a in sections if a not in given]
    assert not never_given, f"sections no error of the code links to: {never_given}"
    assert all(slug(a.replace("-", " ")) == a for a in sections)  # plain words: the same slug on GitHub and mkdocs


def test_every_section_quotes_its_message_as_printed():
    for anchor, lines in quotes().items():
        assert lines, f"section {anchor} quotes no message"
        for line in lines:
            assert line.startswith(("error: ", "- ")), line  # an error line, or a preflight problem under one


def test_every_quoted_section_is_asserted_by_a_test_that_makes_the_mistake():
    asserted = asserted_anchors()
    missing = [anchor for anchor in quotes() if anchor not in asserted]
    assert not missing, f"quoted, but no test asserts them: {missing}"
