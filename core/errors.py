"""User mistakes become one short ``error: ...`` line naming the cause and the fix, and a non-zero exit status
without a traceback; bugs keep their traceback.

Raise :class:`UserError` (or a subclass: the datamodules', the zoo's, the checkpoints' and the launch's errors are)
where a mistake is detected, with the anchor of its section of docs/troubleshooting.md; :func:`report` is the one place
its line is printed (by :func:`app.command.main`, which then exits 1, or 2 (argparse's status) for a command line or
config that does not parse; by a watchdog thread that must end its process itself). Parser errors are reworded here
because jsonargparse's are long (the whole usage text, the union's subtypes) and never suggest the option the user
meant.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Iterable

from core.env import docs_url


class UserError(Exception):
    """A mistake the user fixes (config, data, machine); the message says the cause and the fix.

    ``help`` is the anchor of its section of docs/troubleshooting.md, given where the mistake is found
    (``UserError(message, help="mnist-missing")``); a subclass may set a default for all of its errors. The printed
    line ends with the link to that section (:func:`with_link`). ``said_as`` is the word the line starts with:
    ``error``, or what heals it for a failure a launcher with restarts left takes over (``torchrun``).
    """

    exit_code = 1
    help: str | None = None
    said_as = "error"

    def __init__(self, message: str = "", help: str | None = None) -> None:
        super().__init__(message)
        if help is not None:
            self.help = help


class InvalidValue(UserError, ValueError):
    """A configured value outside what its class accepts (a ``ValueError`` too, for code that builds the class)."""

    help = "invalid-value"


class UsageError(UserError):
    """The command line or a config file does not parse (unknown option, invalid value)."""

    exit_code = 2  # argparse's status for usage errors


def closest(word: str, choices: Iterable[str], n: int = 1) -> list[str]:
    """The ``n`` choices most similar to ``word`` (difflib), best first; empty when none is close."""
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest choice, or an empty string."""
    match = closest(word, choices)
    return f" (did you mean {match[0]}?)" if match else ""


def one_line(err: BaseException) -> str:
    """The message of ``err``; for an error re-raised from a DataLoader worker, the worker's own message only."""
    text = str(err).strip()
    if "Original Traceback" in text:  # torch's ExceptionWrapper: "Caught X in DataLoader worker..." + the traceback
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if re.match(r"^[\w.]+(Error|Exception): ", last) else last
    return text


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--option`` of ``parser`` and of its subcommands' parsers."""
    options: set[str] = set()
    for action in parser._actions:
        options.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= parser_options(sub)
    return options


def explain_parser_error(message: str, options: Iterable[str], prog: str = "python cli.py") -> UsageError:
    """jsonargparse's error ``message`` as one line, with the closest valid option or value."""
    options = sorted(options)
    help_hint = f"All options: `{prog} fit --help`."
    if match := re.match(r"unrecognized arguments: (.*)", message):
        unknown = [t.split("=")[0] for t in match.group(1).split() if t.startswith("--")] or [match.group(1)]
        hints = ", ".join(f"{u}{did_you_mean(u, options)}" for u in unknown)
        return UsageError(f"unknown option {hints}. {help_hint}", help="unknown-option")
    if match := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
        choices = re.findall(r"'([^']*)'", match.group(2))
        hint = did_you_mean(match.group(1), choices)
        text = f"unknown subcommand {match.group(1)!r}{hint}; one of {', '.join(choices)}, e.g. `{prog} fit`."
        return UsageError(text, help="unknown-subcommand")
    if match := re.search(r"(Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)'", message):
        key = f"--{match.group(2)}.{match.group(3)}" if match.group(1) == "Group" else f"--{match.group(3)}"
        text = f"unknown key {key[2:]} in a config file{did_you_mean(key, options).replace('--', '')}. {help_hint}"
        return UsageError(text, help="unknown-config-key")
    # the last "Given value" is the outermost: a nested union (int | Literal) states its own first
    key, given = re.match(r'Parser key "([\w.]+)":', message), re.findall(r"Given value: (.*)", message)
    if key and given:
        name, value = key.group(1), given[-1].strip()
        if nested := re.match(r"NestedArg\(key='([\w.]+)', val=(.*)\)$", value):  # --data.batch_size x
            name, value = f"{name}.{nested.group(1)}", nested.group(2).strip("'")
        if short := re.search(r"Expected a dot import path string: (\S+)", message):  # --trainer.strategy ddp + .X
            return UsageError(_options_of_a_name(key.group(1), short.group(1), name, value))
        literals = [v for group in re.findall(r"Literal\[([^\]]*)\]", message) for v in re.findall(r"'([^']*)'", group)]
        if literals:
            valid = list(dict.fromkeys(literals))
            number = " a number or" if "Subtypes: [<class 'int'>, typing.Literal" in message else ""  # int | Literal
            text = f"{name}={value!r} is not valid{did_you_mean(value, valid)}. Valid:{number} {', '.join(valid)}."
            return UsageError(text, help="invalid-value")
        errors = message.split("Errors:", 1)[-1].split("Given value type", 1)[0].splitlines()
        reasons = [line.strip(" -") for line in errors if line.strip() and "NoneType" not in line]
        reason = reasons[-1] if reasons else message.splitlines()[1].strip()
        return UsageError(f"{name}={value!r} is not valid: {reason}. {help_hint}", help="invalid-value")
    if key and (option := re.search(r"Option '(\w+)' is not accepted", message)):
        return UsageError(
            f"{key.group(1)} has no argument {option.group(1)!r}. See `{prog} fit --{key.group(1)}.help CLASS`."
        )
    return UsageError(message)


def _options_of_a_name(key: str, short: str, option: str, value: str) -> str:
    """``--trainer.strategy ddp --trainer.strategy.process_group_backend gloo``: a registered name takes no options;
    the class does (jsonargparse says only "Expected a dot import path string: ddp")."""
    given = "CLASS"
    if key == "trainer.strategy":
        from lightning.pytorch.strategies import StrategyRegistry

        entry = dict.get(StrategyRegistry, short.lower())  # the registry's own .get() instantiates the strategy
        given = entry["strategy"].__name__ if entry else "DDPStrategy"
        if entry and short.lower() != "ddp":  # ddp's one parameter (start_method popen) is DDPStrategy's default
            given += "".join(f" --{key}.{name} {arg}" for name, arg in entry["init_params"].items())
    return (
        f"--{option} needs a class, but {key} is the name {short!r}, which takes no options. Fix: name the class, "
        f"`--{key} {given} --{option} {value}`, or stack a config fragment (configs/strategy/*.yaml) and set it there."
    )


# --- Every error line ends with the link to its section of docs/troubleshooting.md ------------------------------------
# The base is the page in this repository (what a clone has); a docs site sets DPTRAIN_DOCS_URL to its page's address,
# e.g. https://example.org/dptrain/troubleshooting/ . The anchors are the headings' slugs (lower case, spaces -> "-"),
# the same on GitHub and in mkdocs; each is given where its error is raised, and tests/unit/test_troubleshooting_docs.py
# checks that every anchor the code gives has its section and every section is an anchor the code gives.
DOCS_URL = docs_url()


def with_link(line: str, help: str | None) -> str:
    """``line`` with `` Help: <DOCS_URL>#<help>`` at the end of its first line (the ``error:`` line of a message that
    lists details below it); unchanged without an anchor or when it is linked already."""
    first, newline, rest = line.partition("\n")
    if help is None or f" Help: {DOCS_URL}#" in first:
        return line
    return f"{first} Help: {DOCS_URL}#{help}{newline}{rest}"


def say(text: str) -> None:
    """``text`` and its newline on stderr in one write.

    Every rank of a job prints its ``error:`` line to the same stderr (the launcher's terminal, SLURM's output file)
    at about the same moment. ``print`` and Python's own report of a ``SystemExit`` write the text and the newline
    separately, so two ranks' lines could run into one (``...#disk-fullerror: ...``); one write of at most PIPE_BUF
    (4 KiB) bytes to a pipe is never interleaved with another's.
    """
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (pytest's capsys): nothing shares it
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    data = (text + "\n").encode(sys.stderr.encoding or "utf-8", errors="replace")
    while data:
        data = data[os.write(fd, data) :]


def error_line(err: UserError) -> str:
    """What the user reads for ``err``: ``error: <cause and fix>``, the link to its section at the end of the first
    line (the details a message lists below it follow)."""
    return with_link(f"{err.said_as}: {one_line(err)}", err.help)


def report(err: UserError) -> None:
    """The one place a user error is printed: its :func:`error_line` on this rank's stderr, in one write."""
    say(error_line(err))
