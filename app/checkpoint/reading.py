"""Reading a checkpoint, once per start: :class:`Reader` loads each file on the CPU, memory-mapped (its tensors are
read when used), checks its bytes against the SHA-256 saved with it, and keeps what it found by path and modification
time, so the resume decision, the loggers, the CLI's checks and Lightning's own load all see one read of the file.

``--ckpt_path FILE`` is checked here before a run uses it (:meth:`Reader.given`: missing, truncated, unsafe), each
mistake one :class:`CheckpointError` naming the file, the cause and the fix.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.checkpoint.files import checksum_path, file_checksum, recorded_checksum
from app.checkpoint.identity import RunIdentity
from app.checkpoint.names import local_folder
from app.lightning_private import PATH
from core.errors import UserError

TRUST_FLAG = "--trust_checkpoint true"
# torch's weights-only unpickler names the global it refused ("Unsupported global: GLOBAL os.makedirs was not an allowed
# global"); bytes that are no pickle at all fail it too ("Unsupported operand 211"), and only the former is a refusal.
_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


class CheckpointError(UserError):
    """A ``--ckpt_path`` the run cannot use; raised before anything is built, written or overwritten."""


class UnsafeCheckpointError(UserError, pickle.UnpicklingError):
    """The checkpoint holds pickled Python objects and this run does not trust checkpoints (also for the files
    Lightning resolves itself: ``best``, a registry, a URL)."""

    help = "checkpoint-with-code"


def refused(err: BaseException) -> bool:
    """Whether the safe loader refused a pickled global (a file that holds code), not a file that is no pickle."""
    return "Weights only load failed" in str(err) and _GLOBAL.search(str(err)) is not None


def refusal(path: PATH, err: BaseException) -> str:
    """Why the safe loader refused ``path`` (naming the pickled global it met) and the opt-out."""
    found = _GLOBAL.search(str(err))
    what = f"a pickled Python object ({found.group(1)})" if found else "pickled Python objects"
    return (
        f"{path} holds {what} that could run code when loaded, so it was refused (checkpoints are loaded with "
        f"weights_only=True). Fix: only if you trust where this file comes from, pass {TRUST_FLAG}; otherwise "
        "do not use it."
    )


def load_on_cpu(path: PATH, weights_only: bool = True) -> dict:
    """``path`` on the CPU, memory-mapped where the format allows (its tensors are not read until used)."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as err:  # files in torch's legacy (non-zip) format cannot be memory-mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def readable_copy(path: Path, intact: Callable[[Path], bool]) -> Path:
    """``path``, or its node-local copy when that holds the same bytes (the same recorded SHA-256, and ``intact``: its
    own bytes match it, :meth:`Reader.intact`, which hashes a file once): a restart on this
    node reads its own storage instead of the shared filesystem."""
    folder = local_folder(path.parent)
    local = folder / path.name if folder is not None else None
    if local is None or not local.is_file() or local == path:
        return path
    recorded = recorded_checksum(path)
    if recorded is None or recorded_checksum(local) != recorded or not intact(local):
        return path
    return local


@dataclass(frozen=True)
class Read:
    """What reading one checkpoint file found.

    Attributes:
        path: the file asked for.
        source: the file read: ``path``, or its node-local copy when that holds the same bytes.
        state: the checkpoint on the CPU, memory-mapped; None when it does not read.
        problem: why it does not read (its bytes differ from its SHA-256, or torch's reason); None when it reads.
        error: the exception torch raised, if any (a refused pickled global included).
    """

    path: Path
    source: Path
    state: dict | None = None
    problem: str | None = None
    error: BaseException | None = None

    @property
    def holds_code(self) -> bool:
        """The safe loader refused a pickled global: not a damaged file, a file this run must not trust."""
        return isinstance(self.error, pickle.UnpicklingError) and refused(self.error)

    @property
    def identity(self) -> RunIdentity:
        """The run identity saved in it (empty when it has none or does not read)."""
        return RunIdentity.of(self.state)


class Reader:
    """Reads and verifies each checkpoint file at most once while it is unchanged (its path, size and modification
    time); every reader of a run's checkpoints in this process asks one of these (the run's
    :class:`~app.checkpoint.Checkpoints` holds it).

    Args:
        trust: load with full unpickling (``--trust_checkpoint true``), else ``weights_only=True``.
    """

    def __init__(self, trust: bool = False) -> None:
        self.trust = trust
        self._reads: dict[tuple[str, int, int, int], Read] = {}
        self._intact: dict[tuple[str, int, int, int, str], bool] = {}

    def intact(self, path: Path) -> bool:
        """Whether ``path``'s bytes match the SHA-256 saved with it (True when none was saved), checked once."""
        recorded = recorded_checksum(path)
        if recorded is None:
            return True
        key = (*_key(path), recorded)
        if key not in self._intact:
            self._intact[key] = file_checksum(path) == recorded
        return self._intact[key]

    def read(self, path: Path) -> Read:
        """``path`` read on the CPU (its node-local copy when that holds the same bytes), or why it does not read."""
        try:
            key = _key(path)
        except OSError as err:  # gone since it was listed (another rank moved it aside), or the disk fails
            return Read(Path(path), Path(path), problem=_reason(err), error=err)
        if key not in self._reads:
            self._reads[key] = self._read(Path(path))
        return self._reads[key]

    def keep_only(self, path: Path | None) -> None:
        """Forgets every read but ``path``'s: a read holds its file memory-mapped, so a checkpoint the run deletes
        later would keep its disk space until the process ends."""
        kept = None if path is None else str(Path(path).resolve())
        self._reads = {key: read for key, read in self._reads.items() if key[0] == kept}

    def _read(self, path: Path) -> Read:
        try:
            source = readable_copy(path, self.intact)
            if not self.intact(source):  # bytes changed since the save: truncated or flipped
                problem = f"its SHA-256 differs from the one saved in {checksum_path(path).name}"
                return Read(path, source, problem=problem)
        except OSError as err:  # an I/O error while hashing: the damaged file the fallback exists for
            return Read(path, path, problem=_reason(err), error=err)
        try:
            return Read(path, source, state=load_on_cpu(source, weights_only=not self.trust))
        except Exception as err:  # zip/pickle/OS errors: truncated or corrupt; or a pickled global refused
            return Read(path, source, problem=_reason(err), error=err)

    def given(self, path: PATH) -> dict:
        """``--ckpt_path FILE`` read and checked before a run uses it.

        Raises:
            CheckpointError: the file is missing, truncated or corrupt, or refused by the safe loader; the message is
                one line naming the file, the cause and the fix.
        """
        flag = f"--ckpt_path {path}"
        if not Path(path).is_file():
            raise CheckpointError(
                f"{flag}: no such file. Fix: check the path; `--ckpt_path last` resumes the newest last.ckpt under "
                "--trainer.default_root_dir; leave --ckpt_path out to start from scratch.",
                help="checkpoint-missing",
            )
        read = self.read(Path(path))
        if read.state is not None:
            return read.state
        if read.holds_code and not self.trust:
            raise CheckpointError(f"--ckpt_path {refusal(path, read.error)}", help="checkpoint-with-code")
        cause = read.problem if read.error is None else _torch_says(read.error)
        raise CheckpointError(
            f"{flag}: not a readable checkpoint; it is truncated or corrupt ({cause}). Fix: use an intact copy or an "
            "earlier checkpoint of the run, or leave --ckpt_path out to start from scratch.",
            help="checkpoint-corrupt",
        )

    def load(self, path: PATH, weights_only: bool) -> Read | None:
        """``path`` as read once, when it read with the same trust (else None): what the run's checkpoint I/O hands
        Lightning instead of loading the file again."""
        if weights_only == self.trust or "://" in str(path) or not Path(path).is_file():
            return None
        read = self.read(Path(path))
        return read if read.state is not None else None


def _key(path: Path) -> tuple[str, int, int, int]:
    """The file as it is now: ``os.replace`` (every save) makes a new inode, so a rewrite is never served stale, even
    where modification times are coarse."""
    stat = os.stat(path)
    return str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns


def _reason(err: BaseException) -> str:
    """torch's reason in a few words: its type and last line (a list of passed-over files names each)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {(lines[-1] if lines else '')[:120]}"


def _torch_says(cause: BaseException) -> str:
    """torch's reason as the ``--ckpt_path`` line gives it: its type and first sentence (after its weights_only
    notice, for bytes that are no pickle)."""
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()] or [type(cause).__name__]
    notice = [i for i, line in enumerate(lines) if line.endswith("WeightsUnpickler error:")]
    if notice:
        lines = lines[notice[0] + 1 :] or lines
    return f"{type(cause).__name__}: {lines[0].split('. ')[0][:160]}"
