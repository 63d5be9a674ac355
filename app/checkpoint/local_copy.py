"""The node-local copy (``--checkpoint.local_copy``): after each save of ``last.ckpt``, a copy in the node's own
storage (``$SLURM_TMPDIR``, ``$TMPDIR`` or ``/dev/shm``), which a restart on the same node reads instead of the
shared file while both hold the same SHA-256."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint.files import checksum_path, megabytes, recorded_checksum, write_checksum
from app.checkpoint.names import local_folder, local_root
from core.env import Launch
from core.files import replaced_atomically


def restarts_in_place(launch: Launch) -> bool:
    """Whether the launcher restarts this job's processes on the same node (torchrun ``--max-restarts``, and so torch's
    elastic agent that ``--launch.max_restarts`` starts, which sets torchrun's variables): the local copy's default."""
    return launch.launcher == "torchrun" and launch.max_restarts > 0


class LocalCopies:
    """Copies each saved ``last.ckpt`` into :func:`local_folder` of ``root``; owned by the run's checkpoint I/O.

    A copy never fails the save: a node without room keeps only the shared file, with one warning per folder (the
    folders warned about are this object's). A copy that would take more than a quarter of the free space there is
    not made (``/dev/shm`` is the node's memory).
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else local_root()
        self._warned: set[str] = set()

    def copy(self, path: Path) -> None:
        """Copies the just-saved ``path`` and its checksum, atomically (as the save)."""
        folder, digest = local_folder(path.parent, self.root) if self.root else None, recorded_checksum(path)
        if folder is None or digest is None:
            return
        local = folder / path.name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held = local.stat().st_size if local.is_file() else 0  # replaced by this copy
            if 4 * path.stat().st_size > shutil.disk_usage(folder).free + held:
                raise OSError(errno.ENOSPC, f"{megabytes(path.stat().st_size)} is over a quarter of the free space")
            forget = lambda: _forget_checksum(local)  # noqa: E731
            with replaced_atomically(local, durable=False, before_replace=forget, private=True) as tmp:
                shutil.copyfile(path, tmp)
            write_checksum(local, digest)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(local)  # never an older copy left to read
            if str(folder) not in self._warned:
                self._warned.add(str(folder))
                rank_zero_info(
                    f"warning: checkpoint: no node-local copy of {path} in {folder} ({err.strerror or err}); a "
                    "restart reads the shared file. Fix: set TMPDIR to a node-local disk with room, or "
                    "--checkpoint.local_copy false to stop trying."
                )


def remove_local_copies(folder: Path) -> None:
    """Removes the node-local copies of checkpoint folder ``folder`` (a fit that ended: nothing restarts from them;
    on ``/dev/shm`` they hold the node's memory)."""
    local = local_folder(folder)
    if local is not None and local.is_dir():
        shutil.rmtree(local, ignore_errors=True)


def _forget_checksum(local: Path) -> None:
    """Before a copy replaces ``local``: never a new checksum beside the old file, nor the reverse."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(checksum_path(local))
