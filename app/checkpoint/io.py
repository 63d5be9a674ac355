"""The format and the atomic write: :class:`AtomicCheckpointIO`, the base configuration's checkpoint I/O plugin.

Rank 0 (the strategy calls it there only; all ranks then wait at Lightning's barrier) streams the checkpoint into a
temporary file next to the target, fsyncs it and ``os.replace``-s it over the target, so a crash during a save never
leaves a truncated ``last.ckpt`` (a save killed midway leaves only a hidden ``.last.ckpt.*.partial`` file, which nothing
reads); the file it replaces stays as ``last.previous.ckpt``, and its SHA-256 is written beside it
(:mod:`app.checkpoint.files`). Loading maps tensors to the calling rank's own device and uses ``weights_only=True``: a
checkpoint holding pickled Python objects (which could run code) is refused, unless the user opts out with
``--trust_checkpoint true`` (``AtomicCheckpointIO(weights_only=False)``) for a file they trust. A save that finds the
disk full raises :class:`DiskFullError` (one line: the space needed and free, the previous checkpoint kept) instead of
torch's two tracebacks; :class:`app.trainer.Trainer` makes every rank stop with it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint.disk import tensor_bytes
from app.checkpoint.files import Hashing, checksum_path, megabytes, recorded_checksum, write_checksum
from app.checkpoint.local_copy import LocalCopies
from app.checkpoint.names import LAST, previous_of
from app.checkpoint.reading import Reader, UnsafeCheckpointError, load_on_cpu, readable_copy, refusal, refused
from app.lightning_private import PATH
from app.lightning_private import load as pl_load
from core.errors import UserError
from core.files import fsync_folder, replaced_atomically


def own_device() -> torch.device:
    """The device this process computes on: its current CUDA device (set by Lightning per rank), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with crash-safe local saves and rank-local, ``weights_only`` loads.

    Lightning's own save serialises the whole checkpoint into memory first and relies on fsspec's transaction to
    move it into place; this one streams to disk (no second in-memory copy of a large checkpoint), fsyncs, and
    renames in the same folder, which is atomic on POSIX. Remote URLs (``s3://``...) are left to Lightning.
    """

    def __init__(self, weights_only: bool = True) -> None:
        """
        Args:
            weights_only: load with ``torch.load(weights_only=True)``, which refuses pickled Python objects (they
                could run code). ``False`` trusts every checkpoint this run loads: only for legacy files you trust
                (the CLI sets it with ``--trust_checkpoint true``).
        """
        super().__init__()
        self.weights_only = weights_only
        self.local_copy = False  # also copy each last.ckpt to the node's own storage (the --checkpoint group sets it)
        # the run's reader (set by the plugin :meth:`app.checkpoint.Checkpoints.plugin` builds): a file it has read is
        # not read again (not an argument: the run's saved configuration would list it)
        self.reader: Reader | None = None
        self._copies: LocalCopies | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with replaced_atomically(path, before_replace=lambda: keep_previous(path)) as tmp, open(tmp, "wb") as file:
                hashing = Hashing(file)  # the SHA-256 of the bytes as they are written: no second read
                torch.save(checkpoint, hashing)
            # A crash between the rename and this one leaves the new file with the old SHA-256: a resume then takes it
            # for damaged and falls back to last.previous.ckpt (one interval lost, never a wrong state).
            write_checksum(path, hashing.sha256.hexdigest())
        except BaseException as err:
            if _no_space(err):  # torch reports it as "unexpected pos" in its zip writer, the OSError as its context
                raise DiskFullError(disk_full(path, checkpoint)) from None
            raise
        # partial files of this target left by a process killed while saving (only this rank writes it)
        for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
            with contextlib.suppress(OSError):
                stale.unlink()
        fsync_folder(path.parent)  # make the renames themselves durable
        if self.local_copy and path.name == f"{LAST}.ckpt":
            self._copies = self._copies or LocalCopies()
            self._copies.copy(path)

    def remove_checkpoint(self, path: PATH) -> None:
        super().remove_checkpoint(path)
        with contextlib.suppress(OSError):
            os.unlink(checksum_path(Path(path)))

    def load_checkpoint(self, path: PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Loads onto this rank's own device (never every rank onto GPU 0), or hands over the state the run's
        :attr:`reader` has read already (on the CPU: the Trainer copies it into the model and the optimizer, which
        put it on their devices).

        ``weights_only=None`` (what the Trainer passes) means this plugin's ``weights_only``. A refused checkpoint
        raises :class:`UnsafeCheckpointError` naming the opt-out; there is no silent fallback to full unpickling.
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        read = self.reader.load(path, weights_only) if map_location is None and self.reader is not None else None
        if read is not None:
            local = read.source
        else:  # another map_location, or a plugin used without the run's reader: its checks, once, by a reader
            local = readable_copy(Path(path), (self.reader or Reader()).intact) if "://" not in str(path) else None
        if local is not None and local != Path(path):
            rank_zero_info(f"resume: reading {local}, the node-local copy of {path} (the same SHA-256)")
            path = local
        if read is not None:
            return read.state
        map_location = map_location if map_location is not None else own_device()
        try:
            return pl_load(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            if not weights_only or not refused(err):
                raise
            raise UnsafeCheckpointError(refusal(path, err)) from err


def keep_previous(path: Path) -> None:
    """Before ``path`` (a ``last.ckpt``) is replaced, the file it holds stays as ``last.previous.ckpt``: a resume
    falls back to it when the newest does not read (:class:`~app.checkpoint.Checkpoints`). A hard link: no
    copy, no time; the disk holds one more checkpoint once the new one has replaced the old. Its SHA-256 goes with
    it."""
    previous = previous_of(path)
    if previous is None or not path.is_file():
        return
    link = previous.with_name(f".{previous.name}.link")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    try:
        os.link(path, link)
    except OSError:  # a filesystem without hard links: the newest is still saved atomically, without a fallback
        return
    digest = recorded_checksum(path)
    if digest is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(checksum_path(previous))
    else:  # before the file: a crash in between leaves the older previous with a newer checksum (passed over)
        write_checksum(previous, digest)
    os.replace(link, previous)


class DiskFullError(UserError):
    """A checkpoint could not be saved because its filesystem is full; the previous file at that path is intact."""

    help = "disk-full"


def _no_space(err: BaseException | None) -> bool:
    """Whether ``err`` or an exception it was raised from or during is "No space left on device" (or over quota)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def disk_full(path: Path, checkpoint: dict) -> str:
    """The one line for a save of ``checkpoint`` to ``path`` that found its disk full (the partial file removed)."""
    free = shutil.disk_usage(path.parent).free
    kept = path if path.is_file() else path.parent / f"{LAST}.ckpt"
    if kept.is_file():
        try:
            step = f"global step {load_on_cpu(kept).get('global_step', '?')}"
        except Exception:  # a file this run did not write (the atomic save never leaves a truncated one)
            step = "not written by this save"
        previous = f"the previous {kept} ({step}) is intact"
    else:
        previous = f"nothing was overwritten (no earlier {kept.name} in {path.parent})"
    return (
        f"saving the checkpoint {path} failed: the disk is full (No space left on device): it needs about "
        f"{megabytes(tensor_bytes(checkpoint))} and {megabytes(free)} are free in {path.parent}; {previous}. "
        "Fix: free space on that disk, or set --trainer.default_root_dir to a folder on a disk with room for a few "
        "checkpoints, then resume with `--ckpt_path last`."
    )
