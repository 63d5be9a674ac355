"""User mistakes become one short ``error: ...`` line naming the cause and the fix, and a non-zero exit status
without a traceback; bugs keep their traceback.

Raise :class:`UserError` (or a subclass: the datamodules' and the zoo's errors are) where a mistake is detected;
:func:`app.cli.main` prints it and exits 1, or 2 (argparse's status) for a command line or config that does not
parse. Parser errors are reworded here because jsonargparse's are long (the whole usage text, the union's
subtypes) and never suggest the option the user meant.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
from collections.abc import Iterable, Iterator


class UserError(Exception):
    """A mistake the user fixes (config, data, machine); the message says the cause and the fix."""

    exit_code = 1


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


def explain_parser_error(message: str, options: Iterable[str], prog: str = "python cli.py") -> str:
    """jsonargparse's error ``message`` as one line, with the closest valid option or value."""
    options = sorted(options)
    help_hint = f"All options: `{prog} fit --help`."
    if match := re.match(r"unrecognized arguments: (.*)", message):
        unknown = [t.split("=")[0] for t in match.group(1).split() if t.startswith("--")] or [match.group(1)]
        hints = ", ".join(f"{u}{did_you_mean(u, options)}" for u in unknown)
        return f"unknown option {hints}. {help_hint}"
    if match := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
        choices = re.findall(r"'([^']*)'", match.group(2))
        hint = did_you_mean(match.group(1), choices)
        return f"unknown subcommand {match.group(1)!r}{hint}; one of {', '.join(choices)}, e.g. `{prog} fit`."
    if match := re.search(r"(Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)'", message):
        key = f"--{match.group(2)}.{match.group(3)}" if match.group(1) == "Group" else f"--{match.group(3)}"
        return f"unknown key {key[2:]} in a config file{did_you_mean(key, options).replace('--', '')}. {help_hint}"
    # the last "Given value" is the outermost: a nested union (int | Literal) states its own first
    key, given = re.match(r'Parser key "([\w.]+)":', message), re.findall(r"Given value: (.*)", message)
    if key and given:
        name, value = key.group(1), given[-1].strip()
        if nested := re.match(r"NestedArg\(key='([\w.]+)', val=(.*)\)$", value):  # --data.batch_size x
            name, value = f"{name}.{nested.group(1)}", nested.group(2).strip("'")
        if short := re.search(r"Expected a dot import path string: (\S+)", message):  # --trainer.strategy ddp + .X
            return _options_of_a_name(key.group(1), short.group(1), name, value)
        literals = [v for group in re.findall(r"Literal\[([^\]]*)\]", message) for v in re.findall(r"'([^']*)'", group)]
        if literals:
            valid = list(dict.fromkeys(literals))
            number = " a number or" if "Subtypes: [<class 'int'>, typing.Literal" in message else ""  # int | Literal
            return f"{name}={value!r} is not valid{did_you_mean(value, valid)}. Valid:{number} {', '.join(valid)}."
        errors = message.split("Errors:", 1)[-1].split("Given value type", 1)[0].splitlines()
        reasons = [line.strip(" -") for line in errors if line.strip() and "NoneType" not in line]
        reason = reasons[-1] if reasons else message.splitlines()[1].strip()
        return f"{name}={value!r} is not valid: {reason}. {help_hint}"
    if key and (option := re.search(r"Option '(\w+)' is not accepted", message)):
        return f"{key.group(1)} has no argument {option.group(1)!r}. See `{prog} fit --{key.group(1)}.help CLASS`."
    return message


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
# the same on GitHub and in mkdocs; tests/unit/test_troubleshooting_docs.py checks each one has its section.
DOCS_URL = os.environ.get("DPTRAIN_DOCS_URL", "docs/troubleshooting.md")

# (anchor, a regex searched in the message without its "error: " or "- "): the first that matches is the section
SECTIONS: tuple[tuple[str, str], ...] = (
    ("preflight", r"^preflight: this run cannot start"),
    ("unknown-option", r"^unknown option "),
    ("unknown-subcommand", r"^unknown subcommand "),
    ("unknown-config-key", r"^unknown key \S+ in a config file"),
    ("invalid-value", r"^[\w.]+=.* is not valid"),
    ("unknown-strategy", r"^trainer\.strategy .* is not a registered strategy"),
    ("unknown-arch", r"^Unknown model\.arch "),
    ("unknown-accelerator", r"^trainer\.accelerator .* is unknown"),
    ("batch-size", r"^data\.batch_size=\S+: a batch is a positive number"),
    ("global-batch-size", r"^data\.global_batch_size=\S+ does not split evenly"),
    ("no-gpu", r"^trainer\.accelerator \w+ asks for \S+ GPU"),
    ("ddp-mp-gpus", r"^ddp_mp: trainer\.devices counts processes"),
    ("dp-one-process", r"^strategy dp drives every device of ONE node"),
    ("fp16-on-cpu", r"^precision 16-mixed .* needs a CUDA GPU"),
    ("root-dir-not-writable", r"^trainer\.default_root_dir .* is not writable"),
    ("mnist-missing", r"^MNIST file \S+ is not in "),
    ("mnist-not-fetched", r"^MNIST is not in .* could not be fetched"),
    ("mnist-corrupt", r"is corrupt or not the MNIST file it is named after"),
    ("data-dir-missing", r"^data\.data_dir .* does not exist"),
    ("no-class-folder", r"Couldn't find any class folder|Each class needs a folder with its images"),
    ("one-class", r"has 1 class folder|a classifier needs at least 2 classes"),
    ("different-class-folders", r"have different class folders"),
    ("unreadable-image", r"^cannot read image "),
    ("checkpoint-missing", r"^--ckpt_path .*: no such file"),
    ("checkpoint-last-missing", r"^--ckpt_path last: no checkpoint found"),
    ("checkpoint-corrupt", r"^--ckpt_path .*: not a readable checkpoint"),
    ("checkpoint-other-arch", r"^--ckpt_path .* holds a \S+ network \(model\.arch in the checkpoint\)"),
    ("checkpoint-does-not-fit", r"^--ckpt_path .* does not fit this model"),
    ("checkpoint-with-code", r"that could run code when loaded"),
    ("non-finite-loss", r"^the training loss was not finite"),
    ("lost-rank", r"^lost rank "),
    ("hang-watch", r"^hang watch: (rank .+ of \S+ (is|are) stuck|all \S+ ranks are stuck)"),
    ("disk-full", r"^saving the checkpoint .* failed: the disk is full"),
    ("rendezvous-timeout", r"^the ranks did not all meet within "),
    ("wandb-missing", r"needs the `wandb` package, which is not installed here"),
    (
        "slurm-submit",
        r"^give the cli\.py command after `--`|^say how many processes per node|is not a multiple of --tasks-per-node"
        r"|^data\.num_workers auto takes the CPUs SLURM gives|^this job would stop at its preflight check",
    ),
    ("sbatch", r"^`sbatch` is not on PATH|^sbatch refused "),
    ("imagenet-val-layout", r"^imagenet_val: "),
)


def docs_anchor(message: str) -> str | None:
    """The anchor of the troubleshooting section for ``message`` (with or without its ``error: ``), or None."""
    text = re.sub(r"^\s*(error: |- )", "", message)
    return next((anchor for anchor, pattern in SECTIONS if re.search(pattern, text)), None)


def with_link(line: str, default: str | None = None) -> str:
    """``line`` ending with `` Help: <DOCS_URL>#<anchor>`` when a section explains it, else ``default``'s section
    (once: linking a linked line is a no-op)."""
    anchor = docs_anchor(line) or default
    if anchor is None or f" Help: {DOCS_URL}#" in line:
        return line
    return f"{line} Help: {DOCS_URL}#{anchor}"


def linked(text: str) -> str:
    """Each ``error:`` line and each ``  - problem`` line of ``text`` (a preflight's list) with its link; a problem
    without a section of its own links to the preflight's."""
    if not text.startswith("error: preflight: "):  # other "  - " lines are details of one error (MNIST's "Tried:")
        return "\n".join(with_link(ln) if ln.startswith("error: ") else ln for ln in text.split("\n"))
    return "\n".join(
        with_link(ln, "preflight") if ln.startswith(("error: ", "  - ")) else ln for ln in text.split("\n")
    )


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


@contextlib.contextmanager
def exit_line_in_one_write() -> Iterator[None]:
    """A ``SystemExit`` that carries its message (``error: ...``) ends the process as Python would (the message on
    stderr, status 1), but written with :func:`say`. For the command only: ``app.cli.main`` itself keeps raising it
    with the message, which is what in-process callers (the tests) read."""
    try:
        yield
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        say(err.code)
        raise SystemExit(1) from None
