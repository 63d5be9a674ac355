"""The options reference of the docs site, rendered from the CLI's own parser when the site is built.

``tools/docs_hooks.py`` replaces the line ``<!-- cli-options -->`` of ``docs/reference/cli.md`` with
:func:`markdown`: every option of ``python cli.py fit --help`` (the parser :func:`app.command.main` builds, with
``configs/base.yaml`` and the default recipe loaded, so the defaults are the ones a run starts from), grouped as the
parser groups them, one entry per option (flags, type, default, help), then the ``init_args`` of each data module.
A flag that is added or renamed in the code is in the next build; nothing here is typed by hand.
``python -m tools.docs_reference`` prints the page's generated part.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from typing import Any

from jsonargparse import ArgumentParser

from app.command import CLI, main

DATA_MODULES = ("datamodules.MNISTDataModule", "datamodules.ImageNetDataModule")
_SUPPRESS = argparse.SUPPRESS


class _Parsed(Exception):
    """Raised by :class:`_ParserOnly` once the parser exists: nothing is parsed, instantiated or run."""


class _ParserOnly(CLI):
    parser_built: ArgumentParser | None = None

    def parse_arguments(self, parser: ArgumentParser, args: Any) -> None:
        type(self).parser_built = parser
        raise _Parsed


def fit_parser() -> ArgumentParser:
    """The ``fit`` subcommand's parser, as ``python cli.py fit`` builds it."""
    with contextlib.suppress(_Parsed):
        main(["fit"], cli_class=_ParserOnly)
    parser = _ParserOnly.parser_built
    assert parser is not None, "app.command.main built no parser"
    return parser._subcommands_action._name_parser_map["fit"]


def _text(help_text: str | None) -> str:
    """One table cell: reStructuredText ``code`` as Markdown code, one line, no bare ``|``."""
    text = " ".join((help_text or "").split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)  # :mod:`x` -> `x`
    text = text.replace("``", "`")
    parts = text.split("`")  # outside code spans, <default_root_dir>/debug/rank<R>.log is text, not an HTML tag
    parts[::2] = [part.replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _type(action: argparse.Action) -> str:
    if action.option_strings[0].endswith(".help"):
        return "a class name"
    hint = getattr(action, "_typehint", None)
    if action.choices and not hint:
        return " | ".join(str(c) for c in action.choices)
    if hint is None:
        return ""
    shown = getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")
    return re.sub(r"\b(?:[a-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", shown)  # a.b.Accelerator -> Accelerator


def _default(action: argparse.Action, defaults: Any) -> str:
    if action.default == _SUPPRESS or not action.option_strings:
        return ""
    key = action.dest
    try:
        value = defaults[key] if defaults is not None else action.default
    except (KeyError, TypeError):
        value = action.default
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    shown = repr(value) if isinstance(value, str) else str(value)
    if len(shown) > 40:  # a logger's whole init_args: --print_config shows them
        shown = shown[:37] + "..."
    return f"`{shown.replace('|', '¦')}`"


def _entry(action: argparse.Action, defaults: Any) -> list[str]:
    """One option as a definition-list entry: its flags, type and default, then what it does (a list wraps on a phone,
    where a four-column table would scroll)."""
    head = [", ".join(f"`{flag}`" for flag in action.option_strings)]
    if kind := _type(action):
        head.append(f"*{_text(kind)}*")
    if default := _default(action, defaults):
        head.append(f"default {default}")
    return [" · ".join(head), f":   {_text(action.help) or '-'}", ""]


def _table(actions: list[argparse.Action], defaults: Any) -> list[str]:
    return [line for a in actions if a.option_strings and a.help != _SUPPRESS for line in _entry(a, defaults)]


def _title(group: argparse._ArgumentGroup) -> str:
    return _text((group.title or "").split(". ")[0])


def data_module_rows(class_path: str) -> list[str]:
    """The ``--data.NAME`` options of one data module (its ``__init__`` arguments), as a table."""
    module, _, name = class_path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "data", fail_untyped=False)
    actions = [a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--data.")]
    return _table(actions, None)


def markdown() -> str:
    """The generated part of ``docs/reference/cli.md``: one section per group of ``fit``'s options."""
    parser = fit_parser()
    defaults = parser.get_defaults()
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings]
        if not actions:
            continue
        prefix = {a.option_strings[-1].split(".")[0] for a in actions if "." in a.option_strings[-1]}
        special = {"options": "General", "Linked arguments": "Linked from the data module"}
        heading = special.get(group.title)
        about = {
            "options": "The config files, the printed config, and the app's own switches.",
            "Linked arguments": "Set from the data module when the run starts; you never give them.",
        }.get(group.title, _title(group))
        if any(a.dest == "ckpt_path" for a in actions):
            heading, about = (
                "The subcommand's own",
                "`validate`, `test` and `predict` take these too, and a few of their own.",
            )
        elif heading is None:
            heading = f"`{prefix.pop().lstrip('-')}`" if len(prefix) == 1 else about
        out += [f"### {heading}", "", *([about, ""] if about and about != heading else []), *_table(actions, defaults)]
        out.append("")
        if any(a.dest == "data" for a in actions):
            for class_path in DATA_MODULES:
                out += [
                    f"#### {class_path.rpartition('.')[2]}",
                    "",
                    f"`--data {class_path}` (a recipe's `data.class_path`), then `--data.NAME VALUE` (or"
                    f" `data: {{class_path: {class_path}, init_args: {{NAME: VALUE}}}}`)",
                    "",
                    *data_module_rows(class_path),
                    "",
                ]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
