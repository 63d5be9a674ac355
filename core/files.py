"""Writing a file whole or not at all: :func:`replaced_atomically` (a temporary file beside the target, fsynced, given
the permissions the umask gives a new file, then ``os.replace``-d over the target, as timm's ``CheckpointSaver`` does),
so a process killed midway never leaves a half-written file under the target's name."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_folder(folder: Path) -> None:
    """Makes the renames in ``folder`` durable, where the filesystem allows it."""
    with contextlib.suppress(OSError):  # not possible on every filesystem
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextlib.contextmanager
def replaced_atomically(
    target: str | Path,
    durable: bool = True,
    before_replace: Callable[[], None] | None = None,
    suffix: str = ".partial",
    private: bool = False,
) -> Iterator[Path]:
    """Yields a temporary path beside ``target`` (hidden: ``.<name>.<random><suffix>``) to write whole; when the block
    ends without an exception it replaces ``target`` in one rename, else it is removed.

    Args:
        target: the file to write.
        durable: fsync the file before the rename (its bytes are on disk once the name points at them).
        before_replace: called between the write and the rename (a checkpoint keeps the file it replaces).
        suffix: the temporary file's (a process killed while writing leaves it: its owner knows the name).
        private: keep mkstemp's 0600 (a copy in a node's shared scratch space, which other users of the node see).
    """
    target = Path(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    tmp = Path(name)
    try:
        # mkstemp creates the file 0600; open() would honour the umask, so do the same: on a shared project folder
        # the team reads these files like the run's others.
        try:
            if not private:
                os.fchmod(fd, 0o666 & ~umask())
        finally:
            os.close(fd)
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
