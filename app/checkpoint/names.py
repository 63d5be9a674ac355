"""Where a run's checkpoints are: the run folder's layout and the names of its files, in one place (nothing else
spells these names)::

    <trainer.default_root_dir>/            the run folder (configs: runs/<recipe>); loggers without save_dir write here
        version_N/                         one run: TensorBoard events, config.yaml, summary.json
            checkpoints/last.ckpt          the newest state of that run (``--ckpt_path last``, SIGTERM)
            checkpoints/last.previous.ckpt the last.ckpt before it (a fallback when the newest does not read)
            checkpoints/epoch=...ckpt      the best by val/acc1 (the --checkpoint group)
        checkpoints/last.ckpt              the same for a run without a logger (``--trainer.logger false``)
        hpc_ckpt_N.ckpt                    SLURM's requeue checkpoint (Lightning saves and resumes the highest N)

and the node-local copies (``--checkpoint.local_copy``) in ``<node storage>/dptrain-checkpoints-<uid>/<folder key>/``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from lightning.pytorch import Trainer

from core.env import Launch, detect

LAST = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST: the file name of the newest state of a run, without ".ckpt"
PREVIOUS = f"{LAST}.previous"  # the last.ckpt before the newest, kept by each save of a last.ckpt (a fallback)


def run_folder(default_root_dir: str | Path | None) -> Path:
    """The run folder that ``trainer.default_root_dir`` names (the current folder when unset)."""
    return Path(default_root_dir or ".")


def resumable_checkpoints(root_dir: str | Path, dirpath: str | Path | None = None) -> list[Path]:
    """Every checkpoint of the runs below ``root_dir``, newest first (a ``last.ckpt`` before any other file of the
    same age): the newest ``last.ckpt``, then what a resume falls back to when it does not read
    (``last.previous.ckpt``, the best checkpoints, earlier runs). A run with a logger saves in
    ``version_N/checkpoints/``, one without (``--trainer.logger false``: Lightning's ModelCheckpoint then saves in the
    run folder itself) in ``checkpoints/``; ``dirpath`` (``--checkpoint.dirpath``) is searched too when set."""
    found = _glob(Path(root_dir), dirpath, "*.ckpt")
    return sorted(found, key=lambda p: (mtime(p), p.name == f"{LAST}.ckpt"), reverse=True)


def mtime(path: Path) -> float:
    """``path``'s modification time; 0 for a file gone since it was listed (another rank moved it aside)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _glob(root_dir: Path, dirpath: str | Path | None, name: str) -> set[Path]:
    found = {*root_dir.glob(f"version_*/checkpoints/{name}"), *root_dir.glob(f"checkpoints/{name}")}
    return found | set(Path(dirpath).glob(name)) if dirpath is not None else found


def hpc_checkpoints(root_dir: str | Path) -> list[Path]:
    """The ``hpc_ckpt_N.ckpt`` files Lightning saves at a SLURM preemption in ``root_dir``, highest N first: the
    file Lightning's SLURM auto-requeue resumes from is the first (its checkpoint connector's ``_hpc_resume_path``)."""
    numbered = ((re.search(r"_(\d+)\.ckpt$", p.name), p) for p in Path(root_dir).glob("hpc_ckpt_*.ckpt"))
    return [p for _, p in sorted(((int(m.group(1)), p) for m, p in numbered if m), reverse=True)]


def previous_of(path: Path) -> Path | None:
    """Where the save of ``path`` keeps the file it replaces: ``last.previous.ckpt`` for a ``last.ckpt``, else None."""
    return path.with_name(f"{PREVIOUS}.ckpt") if path.name == f"{LAST}.ckpt" else None


def where_last_is(root_dir: str | Path, dirpath: str | Path | None = None) -> str:
    """The folders :func:`resumable_checkpoints` searches, for a message."""
    folder = Path(root_dir).resolve()
    extra = f" or {Path(dirpath).resolve()}/ (--checkpoint.dirpath)" if dirpath is not None else ""
    return f"{folder}/version_*/checkpoints/ or {folder}/checkpoints/ (runs with --trainer.logger false){extra}"


def version_of(last: Path) -> str | None:
    """The ``version_N`` a run's ``version_N/checkpoints/last.ckpt`` belongs to (the loggers continue it), or None
    for a ``last.ckpt`` in no version folder (a run without a logger, ``--checkpoint.dirpath``)."""
    version = last.parent.parent.name
    return version if last.parent.name == "checkpoints" and version.startswith("version_") else None


def last_checkpoint_of(trainer: Trainer) -> Path:
    """Where this run writes its ``last.ckpt``: the checkpoint callback's folder, the run folder without one."""
    ckpt = trainer.checkpoint_callback
    folder = Path(ckpt.dirpath if ckpt is not None and ckpt.dirpath else trainer.default_root_dir)
    return folder / f"{getattr(ckpt, 'CHECKPOINT_NAME_LAST', None) or LAST}.ckpt"


def unreadable(path: Path) -> Path:
    """Where a checkpoint that does not read is kept once a resume passed it over (no longer a ``.ckpt``)."""
    return path.with_name(f"{path.name}.unreadable")


def local_root(launch: Launch | None = None) -> Path | None:
    """The node's own storage for checkpoint copies: ``$SLURM_TMPDIR``, ``$TMPDIR`` (per-job folders on many
    clusters), else ``/dev/shm`` (memory); None when none exists."""
    for where in (*(launch or detect()).node_storage, "/dev/shm"):
        if Path(where).is_dir() and os.access(where, os.W_OK):
            return Path(where)
    return None


def local_folder(folder: Path, root: Path | None = None) -> Path | None:
    """The node-local folder that mirrors the checkpoint folder ``folder`` (one per run folder, by its real path)
    under ``root`` (default: :func:`local_root`)."""
    root = root if root is not None else local_root()
    if root is None:
        return None
    key = hashlib.sha1(os.path.realpath(folder).encode()).hexdigest()[:16]
    return root / f"dptrain-checkpoints-{os.getuid()}" / key
