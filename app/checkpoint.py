"""Checkpoints that survive crashes and resume exactly.

- :class:`AtomicCheckpointIO`: rank 0 (the strategy calls it there only; all ranks then wait at Lightning's barrier)
  streams the checkpoint into a temporary file next to the target, fsyncs it and ``os.replace``-s it over the target,
  so a crash during a save never leaves a truncated ``last.ckpt`` (a save killed midway leaves only a hidden
  ``.last.ckpt.*.partial`` file, which nothing reads). Loading maps tensors to the calling rank's own device and uses
  ``weights_only=True``: a checkpoint holding pickled Python objects (which could run code) is refused, unless the
  user opts out with ``--trust_checkpoint true`` (``AtomicCheckpointIO(weights_only=False)``) for a file they trust.
  A save that finds the disk full raises :class:`DiskFullError` (one line: the space needed and free, the previous
  checkpoint kept) instead of torch's two tracebacks; :class:`Trainer` (the CLI's) makes every rank stop with it.
- A SHA-256 of every saved file, written beside it as ``<name>.sha256`` (the format of ``sha256sum``: ``sha256sum -c
  last.ckpt.sha256`` checks it by hand). A resume passes over a file whose bytes no longer match it
  (:mod:`app.resume`), and ``--ckpt_path FILE`` refuses one.
- :class:`BackgroundSaves`: Lightning's ``AsyncCheckpointIO`` around it; the saves made during training are written
  by a thread while training goes on (``--checkpoint.background``).
- The node-local copy (``--checkpoint.local_copy``): after each save of ``last.ckpt``, a copy in the node's own
  storage (``$SLURM_TMPDIR``, ``$TMPDIR`` or ``/dev/shm``), which a restart on the same node reads instead of the
  shared file when both have the same SHA-256.
- :func:`read_checkpoint` and :func:`check_fits`: the CLI's checks of ``--ckpt_path`` before a run uses it (missing,
  truncated, unsafe, another architecture), each a one-line message with the fix.
- :func:`evaluation_dirpath`: the folder a loaded checkpoint was saved in. Which checkpoint a run resumes from
  (``--ckpt_path last``, a restart) is :mod:`app.resume`'s decision.

The random generator states of a checkpoint are :class:`app.callbacks.RNGState`'s.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import importlib
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection

from app import run_dir
from core.errors import with_link

TRUST_FLAG = "--trust_checkpoint true"


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

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        try:
            # mkstemp creates the file 0600; torch.save (open()) would honour the umask, so do the same: on a shared
            # project folder the team reads the checkpoints like the run's other files.
            os.fchmod(fd, 0o666 & ~_umask())
            with os.fdopen(fd, "wb") as file:
                hashing = _Hashing(file)  # the SHA-256 of the bytes as they are written: no second read
                torch.save(checkpoint, hashing)
                file.flush()
                os.fsync(file.fileno())
            keep_previous(path)
            os.replace(tmp, path)
            # A crash between these two renames leaves the new file with the old SHA-256: a resume then takes it for
            # damaged and falls back to last.previous.ckpt (one interval lost, never a wrong state).
            write_checksum(path, hashing.sha256.hexdigest())
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if _no_space(err):  # torch reports it as "unexpected pos" in its zip writer, the OSError as its context
                raise DiskFullError(disk_full(path, checkpoint)) from None
            raise
        # partial files of this target left by a process killed while saving (only this rank writes it)
        for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
            with contextlib.suppress(OSError):
                stale.unlink()
        _fsync_folder(path.parent)  # make the renames themselves durable
        if self.local_copy and path.name == f"{run_dir.LAST}.ckpt":
            copy_locally(path)

    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        with contextlib.suppress(OSError):
            os.unlink(checksum_path(Path(path)))

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Loads onto this rank's own device (never every rank onto GPU 0).

        ``weights_only=None`` (what the Trainer passes) means this plugin's ``weights_only``. A refused checkpoint
        raises :class:`UnsafeCheckpointError` naming the opt-out; there is no silent fallback to full unpickling.
        """
        map_location = map_location if map_location is not None else own_device()
        weights_only = self.weights_only if weights_only is None else weights_only
        if "://" not in str(path) and (local := readable_copy(Path(path))) != Path(path):
            rank_zero_info(f"resume: reading {local}, the node-local copy of {path} (the same SHA-256)")
            path = local
        try:
            return pl_load(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            if not weights_only or not _refused(err):
                raise
            raise UnsafeCheckpointError(refusal(path, err)) from err


def keep_previous(path: Path) -> None:
    """Before ``path`` (a ``last.ckpt``) is replaced, the file it holds stays as ``last.previous.ckpt``: a resume
    falls back to it when the newest does not read (:mod:`app.resume`). A hard link: no copy, no time; the disk
    holds one more checkpoint once the new one has replaced the old. Its SHA-256 goes with it."""
    previous = run_dir.previous_of(path)
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


# --- checksums ---------------------------------------------------------------------------------------------------


class _Hashing:
    """A binary file that also feeds every byte written to a SHA-256 (``torch.save`` writes its zip sequentially)."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of checkpoint ``path`` is kept: ``<name>.sha256``, in the format of ``sha256sum``."""
    return path.with_name(f"{path.name}.sha256")


def write_checksum(path: Path, digest: str) -> None:
    """Writes ``digest`` as ``path``'s checksum file, atomically (the file or its previous version, never half)."""
    target = checksum_path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(f"{digest}  {path.name}\n")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def recorded_checksum(path: Path) -> str | None:
    """The SHA-256 saved with ``path``, or None when it has none (a file saved by another tool or version)."""
    try:
        text = checksum_path(path).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0].lower() if text and len(text[0]) == 64 else None


def file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


# (path, size, mtime, recorded checksum) -> whether the bytes match it: a resume asks once per process, not per reader
_CHECKED: dict[tuple[str, int, int, str], bool] = {}


def checksum_problem(path: Path) -> str | None:
    """Why ``path`` fails its checksum (its bytes changed after the save: a disk fault, an incomplete copy), or None
    when they match or no checksum was saved with it."""
    recorded = recorded_checksum(path)
    if recorded is None:
        return None
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, recorded)
    if key not in _CHECKED:
        _CHECKED[key] = file_checksum(path) == recorded
    return None if _CHECKED[key] else f"its SHA-256 differs from the one saved in {checksum_path(path).name}"


# --- the node-local copy -----------------------------------------------------------------------------------------


def local_root() -> Path | None:
    """The node's own storage for checkpoint copies: ``$SLURM_TMPDIR``, ``$TMPDIR`` (per-job folders on many
    clusters), else ``/dev/shm`` (memory); None when none exists."""
    for where in (os.environ.get("SLURM_TMPDIR"), os.environ.get("TMPDIR"), "/dev/shm"):
        if where and Path(where).is_dir() and os.access(where, os.W_OK):
            return Path(where)
    return None


def local_folder(folder: Path) -> Path | None:
    """The node-local folder that mirrors the checkpoint folder ``folder`` (one per run folder, by its real path)."""
    root = local_root()
    if root is None:
        return None
    key = hashlib.sha1(os.path.realpath(folder).encode()).hexdigest()[:16]
    return root / f"dptrain-checkpoints-{os.getuid()}" / key


_WARNED: set[str] = set()  # the node-local folders this process has warned about


def copy_locally(path: Path) -> None:
    """Copies the just-saved ``path`` and its checksum into :func:`local_folder` (atomically, as the save). Never
    fails the save: a node without room keeps only the shared file, with one warning. A copy that would take more
    than a quarter of the free space there is not made (``/dev/shm`` is the node's memory)."""
    folder, digest = local_folder(path.parent), recorded_checksum(path)
    if folder is None or digest is None:
        return
    local = folder / path.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        held = local.stat().st_size if local.is_file() else 0  # replaced by this copy
        if 4 * path.stat().st_size > shutil.disk_usage(folder).free + held:
            raise OSError(errno.ENOSPC, f"{megabytes(path.stat().st_size)} is over a quarter of the free space")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=folder)
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(checksum_path(local))  # never a new checksum beside the old file, nor the reverse
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        write_checksum(local, digest)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(local)  # never an older copy left to read
        if str(folder) not in _WARNED:
            _WARNED.add(str(folder))
            rank_zero_info(
                f"warning: checkpoint: no node-local copy of {path} in {folder} ({err.strerror or err}); a restart "
                "reads the shared file. Fix: set TMPDIR to a node-local disk with room, or --checkpoint.local_copy "
                "false to stop trying."
            )


def readable_copy(path: Path) -> Path:
    """``path``, or its node-local copy when that holds the same bytes (the same recorded SHA-256, and its own bytes
    match it): a restart on this node reads its own storage instead of the shared filesystem."""
    folder = local_folder(path.parent)
    local = folder / path.name if folder is not None else None
    if local is None or not local.is_file() or local == path:
        return path
    recorded = recorded_checksum(path)
    if recorded is None or recorded_checksum(local) != recorded or checksum_problem(local) is not None:
        return path
    return local


def remove_local_copies(folder: Path) -> None:
    """Removes the node-local copies of checkpoint folder ``folder`` (a fit that ended: nothing restarts from them;
    in ``/dev/shm`` they hold memory)."""
    local = local_folder(folder)
    if local is not None and local.is_dir():
        shutil.rmtree(local, ignore_errors=True)


# --- saving in the background ------------------------------------------------------------------------------------


class BackgroundSaves(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` around :class:`AtomicCheckpointIO`: a save made while :attr:`deferring`
    (the periodic saves during training, :class:`app.callbacks.ModelCheckpoint`) is written by a thread while
    training goes on; every other save (the end of fit, a signal's) is waited for.

    Lightning's version clones every tensor on its own device (a second copy of the weights and optimizer state in
    GPU memory) and reports a failed save only at the next one without waiting for it; here the snapshot goes to
    host memory, at most one save is in flight (the next save, a removal and the teardown wait for it first), and a
    failure (a full disk: :class:`DiskFullError`) is raised there on rank 0, where :class:`app.trainer.Trainer`
    shares it with every rank.
    """

    def __init__(self, checkpoint_io: AtomicCheckpointIO) -> None:
        super().__init__(checkpoint_io)
        self.deferring = False
        self._pending = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.wait()
        snapshot = apply_to_collection(checkpoint, torch.Tensor, _to_host)  # the state as of now, on the host
        self._ensure_setup()
        self._pending = self._executor.submit(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options)
        if not self.deferring:
            self.wait()

    def wait(self) -> None:
        """Until the save in flight (if any) is on disk; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def remove_checkpoint(self, path: _PATH) -> None:
        self.wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            super().teardown()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not possible on every filesystem
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class DiskFullError(SystemExit):
    """A checkpoint could not be saved because its filesystem is full; the previous file at that path is intact."""


def _no_space(err: BaseException | None) -> bool:
    """Whether ``err`` or an exception it was raised from or during is "No space left on device" (or over quota)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a checkpoint (nested dicts, lists, tuples): nearly all of its size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def megabytes(size: float) -> str:
    return f"{size / 1e6:.1f} MB"


def disk_full(path: Path, checkpoint: dict) -> str:
    """The one line for a save of ``checkpoint`` to ``path`` that found its disk full (the partial file removed)."""
    free = shutil.disk_usage(path.parent).free
    kept = path if path.is_file() else path.parent / f"{run_dir.LAST}.ckpt"
    if kept.is_file():
        try:
            step = f"global step {load_on_cpu(kept).get('global_step', '?')}"
        except Exception:  # a file this run did not write (the atomic save never leaves a truncated one)
            step = "not written by this save"
        previous = f"the previous {kept} ({step}) is intact"
    else:
        previous = f"nothing was overwritten (no earlier {kept.name} in {path.parent})"
    return with_link(
        f"error: saving the checkpoint {path} failed: the disk is full (No space left on device): it needs about "
        f"{megabytes(tensor_bytes(checkpoint))} and {megabytes(free)} are free in {path.parent}; {previous}. "
        "Fix: free space on that disk, or set --trainer.default_root_dir to a folder on a disk with room for a few "
        "checkpoints, then resume with `--ckpt_path last`.",
        "disk-full",
    )


def checkpoint_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes of a checkpoint of ``model`` trained with ``optimizer``, before any exists: the weights and
    buffers, plus the optimizer's state per weight (Adam-like optimizers keep two tensors, the others at most one)."""
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    slots = 2 if optimizer is not None and "adam" in type(optimizer).__name__.lower() else 1
    return weights * (1 + slots) + sum(t.numel() * t.element_size() for t in model.buffers())


def low_disk_space(folder: _PATH, estimate: int, room_for: int = 3) -> str | None:
    """A warning when ``folder`` (or its nearest existing parent) has room for fewer than ``room_for`` checkpoints
    of ``estimate`` bytes (the atomic save needs a second copy next to the one it replaces), else None."""
    where = Path(folder).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free >= room_for * estimate:
        return None
    return (
        f"warning: preflight: {where} has {megabytes(free)} free, room for {free / estimate:.1f} checkpoints of "
        f"about {megabytes(estimate)} (estimated from the model and the optimizer); a save that finds the disk full "
        f"stops the run. Fix: free space there, or set --trainer.default_root_dir to a disk with room for "
        f"{room_for} or more."
    )


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint holds pickled Python objects and this run does not trust checkpoints."""


class CheckpointError(SystemExit):
    """A ``--ckpt_path`` the run cannot use; raised before anything is built, written or overwritten."""


# torch's weights-only unpickler names the global it refused ("Unsupported global: GLOBAL os.makedirs was not an allowed
# global"); bytes that are no pickle at all fail it too ("Unsupported operand 211"), and only the former is a refusal.
_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _refused(err: BaseException) -> bool:
    """Whether the safe loader refused a pickled global (a file that holds code), not a file that is no pickle."""
    return "Weights only load failed" in str(err) and _GLOBAL.search(str(err)) is not None


def refusal(path: _PATH, err: BaseException) -> str:
    """Why the safe loader refused ``path`` (naming the pickled global it met) and the opt-out."""
    found = _GLOBAL.search(str(err))
    what = f"a pickled Python object ({found.group(1)})" if found else "pickled Python objects"
    return (
        f"{path} holds {what} that could run code when loaded, so it was refused (checkpoints are loaded with "
        f"weights_only=True). Fix: only if you trust where this file comes from, pass {TRUST_FLAG}; otherwise "
        "do not use it."
    )


def load_on_cpu(path: _PATH, weights_only: bool = True) -> dict:
    """``path`` on the CPU, memory-mapped where the format allows (its tensors are not read until used)."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as err:  # files in torch's legacy (non-zip) format cannot be memory-mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def read_checkpoint(path: _PATH, trust: bool = False) -> dict:
    """``path`` loaded on the CPU and memory-mapped (tensors are not read), to check it before a run uses it.

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, or refused by the safe loader; the message is one
            line naming the file, the cause and the fix.
    """
    flag = f"error: --ckpt_path {path}"
    if not Path(path).is_file():
        raise CheckpointError(
            with_link(
                f"{flag}: no such file. Fix: check the path; `--ckpt_path last` resumes the newest last.ckpt under "
                "--trainer.default_root_dir; leave --ckpt_path out to start from scratch.",
                "checkpoint-missing",
            )
        )
    if problem := checksum_problem(readable_copy(Path(path))):
        raise CheckpointError(
            with_link(
                f"{flag}: not a readable checkpoint; it is truncated or corrupt ({problem}). Fix: use an intact copy "
                "or an earlier checkpoint of the run, or leave --ckpt_path out to start from scratch.",
                "checkpoint-corrupt",
            )
        )
    try:
        return load_on_cpu(path, weights_only=not trust)
    except pickle.UnpicklingError as err:
        if not trust and _refused(err):
            raise CheckpointError(
                with_link(f"error: --ckpt_path {refusal(path, err)}", "checkpoint-with-code")
            ) from None
        cause = err
    except Exception as err:  # zip/pickle/OS errors: a truncated copy, an interrupted download, another format
        cause = err
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()] or [type(cause).__name__]
    notice = [i for i, line in enumerate(lines) if line.endswith("WeightsUnpickler error:")]
    if notice:  # bytes that are no pickle: torch's first lines are its weights_only notice, then the reason
        lines = lines[notice[0] + 1 :] or lines
    torch_says = lines[0].split(". ")[0][:160]
    raise CheckpointError(
        with_link(
            f"{flag}: not a readable checkpoint; it is truncated or corrupt ({type(cause).__name__}: {torch_says}). "
            "Fix: use an intact copy or an earlier checkpoint of the run, or leave --ckpt_path out to start from "
            "scratch.",
            "checkpoint-corrupt",
        )
    )


def _arch(checkpoint: dict) -> str | None:
    return (checkpoint.get("hyper_parameters") or {}).get("arch")


def check_arch(checkpoint: dict, path: _PATH, arch: str | None) -> None:
    """Stops when the checkpoint's network (``model.arch`` in its hyperparameters) is not the one configured.

    LightningCLI would silently replace the configured ``model.arch`` by the checkpoint's; a run that asked for
    another network must say so instead.
    """
    saved = _arch(checkpoint)
    if saved is not None and arch is not None and saved != arch:
        raise CheckpointError(
            with_link(
                f"error: --ckpt_path {path} holds a {saved} network (model.arch in the checkpoint) but this run asks "
                f"for model.arch={arch}. Fix: --model.arch {saved} to continue that model, or leave --ckpt_path out to "
                f"train {arch} from scratch.",
                "checkpoint-other-arch",
            )
        )


def check_fits(checkpoint: dict, path: _PATH, model: torch.nn.Module, arch: str | None = None) -> None:
    """Stops when the checkpoint's weights do not fit ``model`` (other network, classes or input channels),
    before the Trainer's ``load_state_dict`` would fail with a wall of missing keys and size mismatches."""
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return
    mine = model.state_dict()
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    wrong = [k for k in mine if k in saved and tuple(saved[k].shape) != tuple(mine[k].shape)]
    if not (missing or unexpected or wrong):
        return
    example = (
        f"{wrong[0]} is {list(saved[wrong[0]].shape)} there, {list(mine[wrong[0]].shape)} here"
        if wrong
        else f"{(missing or unexpected)[0]} is {'missing there' if missing else 'unknown here'}"
    )
    saved_arch = _arch(checkpoint) or "unknown"
    raise CheckpointError(
        with_link(
            f"error: --ckpt_path {path} does not fit this model (model.arch={arch}): it was trained as {saved_arch} "
            f"and {len(wrong)} weight shapes differ, {len(missing)} are missing, {len(unexpected)} unknown "
            f"(e.g. {example}). "
            "Fix: run with the settings it was trained with (model.arch and the same data: classes and channels), "
            "or leave --ckpt_path out to start from scratch.",
            "checkpoint-does-not-fit",
        )
    )


def read_given_checkpoint(config: Any) -> dict | None:
    """Reads and checks ``--ckpt_path FILE`` before anything is built (missing, truncated, unsafe, other ``arch``).

    None for no path, the names resolved later (``last`` and ``hpc`` by :mod:`app.resume`, the others by
    Lightning) and URLs.
    """
    path = config.get("ckpt_path")
    if not path or path in ("last", "best", "hpc", "registry") or "://" in str(path):
        return None
    checkpoint = read_checkpoint(path, trust=config.trust_checkpoint)
    check_arch(checkpoint, path, config.model.get("arch"))
    return checkpoint


def saved_hparams(checkpoint: dict) -> dict:
    """The model hyperparameters of ``checkpoint`` as LightningCLI applies them (``class_path`` + ``dict_kwargs``)."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    if "_class_path" in hparams:
        hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    return hparams


def weights_from_checkpoint(config: Any) -> None:
    """A run that loads a checkpoint takes the network's weights from it: ``model.weights`` (pretrained weights the
    first run started from) is not read again, so resuming or evaluating needs neither the file nor a download.
    The first run's ``config.yaml`` still names them."""
    weights = config.model.get("weights")
    if weights:
        rank_zero_info(f"model.weights {weights} not loaded: the checkpoint holds the network's weights")
        config.model.weights = None


def evaluation_dirpath(config: Any, checkpoint: dict | None) -> None:
    """validate/test/predict: ModelCheckpoint keeps the folder the loaded checkpoint was saved in.

    Outside ``fit`` it saves nothing, but Lightning restores its state from the checkpoint and, for a new run
    folder, warns that "the dirpath has changed" (or, without the callback, that it is missing): noise here.
    """
    saved = (checkpoint or {}).get("callbacks") or {}
    folders = {v.get("dirpath") for k, v in saved.items() if str(k).startswith("ModelCheckpoint")}
    if len(folders) != 1:
        return  # none saved, or several checkpoint callbacks: nothing to infer
    (folder,) = folders
    if config.get("checkpoint") is not None and config.checkpoint.get("dirpath") is None:  # the --checkpoint group
        config.checkpoint.dirpath = folder
    for callback in config.trainer.get("callbacks") or []:  # a ModelCheckpoint given in trainer.callbacks
        init_args = getattr(callback, "init_args", None)
        if init_args is not None and init_args.get("dirpath") is None and _is_model_checkpoint(callback):
            init_args.dirpath = folder


def _is_model_checkpoint(config: Any) -> bool:
    """Whether a ``class_path`` entry of the config names ModelCheckpoint or a subclass of it."""
    module, _, name = config.class_path.rpartition(".")
    return issubclass(getattr(importlib.import_module(module), name), ModelCheckpoint)
