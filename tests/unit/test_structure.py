"""The shape of the library code: no function over ``MAX_LINES`` lines (its ``def`` line to its last line, decorators
left out) in the library folders, so that each reads top to bottom on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("app", "core", "datamodules", "modules")
MAX_LINES = 60


def long_functions(root: Path = ROOT, folders: tuple[str, ...] = LIBRARY, limit: int = MAX_LINES) -> list[str]:
    """``path:function:lines`` for every function or method in ``root``'s ``folders`` longer than ``limit`` lines."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root).as_posix()}:{node.name}:{lines}")
    return found


def test_no_library_function_is_over_60_lines():
    too_long = long_functions()
    assert not too_long, f"functions over {MAX_LINES} lines (split them): " + ", ".join(too_long)


def test_the_check_counts_from_the_def_line_to_the_last(tmp_path):
    (tmp_path / "lib").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES - 1))
    source = f"class C:\n    def fits(self):\n{body}\n    def over(self):\n{body}        return 0\n"
    (tmp_path / "lib" / "m.py").write_text(source)
    assert long_functions(tmp_path, ("lib",)) == [f"lib/m.py:over:{MAX_LINES + 1}"]
