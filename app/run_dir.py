"""The run folder's layout, in one place: where a run writes and which file counts as "the last checkpoint".

::

    <trainer.default_root_dir>/            the run folder (configs: runs/<recipe>); loggers without save_dir write here
        version_N/                         one run: TensorBoard events, config.yaml, summary.json
            checkpoints/last.ckpt          the newest state of that run (``--ckpt_path last``, SIGTERM)
            checkpoints/epoch=...ckpt      the best by val/acc1 (the --checkpoint group)
        checkpoints/last.ckpt              the same for a run without a logger (``--trainer.logger false``)
        hpc_ckpt_N.ckpt                    SLURM's requeue checkpoint (Lightning saves and resumes the highest N)

:mod:`app.checkpoint` (``--ckpt_path last``), :mod:`app.loggers` (a resumed or restarted run's folder),
:class:`app.callbacks.SIGTERMCheckpoint` and the preflight ask this module; nothing else spells these names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch import Trainer

LAST = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST: the file name of the newest state of a run, without ".ckpt"
PREVIOUS = f"{LAST}.previous"  # the last.ckpt before the newest, kept by each save of a last.ckpt (a fallback)


def root(default_root_dir: str | Path | None) -> Path:
    """The run folder that ``trainer.default_root_dir`` names (the current folder when unset)."""
    return Path(default_root_dir or ".")


def last_checkpoints(root_dir: str | Path, dirpath: str | Path | None = None) -> list[Path]:
    """Every run's ``last.ckpt`` below ``root_dir``, newest first: a run with a logger writes it in
    ``version_N/checkpoints/``, one without (``--trainer.logger false``: Lightning's ModelCheckpoint then saves in the
    run folder itself) in ``checkpoints/``; ``dirpath`` (``--checkpoint.dirpath``) is searched too when set."""
    root = Path(root_dir)
    found = {*root.glob(f"version_*/checkpoints/{LAST}.ckpt"), *root.glob(f"checkpoints/{LAST}.ckpt")}
    if dirpath is not None:
        found |= set(Path(dirpath).glob(f"{LAST}.ckpt"))
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_last_checkpoint(root_dir: str | Path, dirpath: str | Path | None = None) -> Path | None:
    """The newest ``last.ckpt`` of the runs below ``root_dir`` (:func:`last_checkpoints`), or None."""
    found = last_checkpoints(root_dir, dirpath)
    return found[0] if found else None


def resumable_checkpoints(root_dir: str | Path, dirpath: str | Path | None = None) -> list[Path]:
    """Every checkpoint in the folders :func:`last_checkpoints` searches, newest first (a ``last.ckpt`` before any
    other file of the same age): the newest ``last.ckpt``, then what a resume falls back to when it does not read
    (``last.previous.ckpt``, the best checkpoints, earlier runs)."""
    root = Path(root_dir)
    found = {*root.glob("version_*/checkpoints/*.ckpt"), *root.glob("checkpoints/*.ckpt")}
    if dirpath is not None:
        found |= set(Path(dirpath).glob("*.ckpt"))
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name == f"{LAST}.ckpt"), reverse=True)


def previous_of(path: Path) -> Path | None:
    """Where the save of ``path`` keeps the file it replaces: ``last.previous.ckpt`` for a ``last.ckpt``, else None."""
    return path.with_name(f"{PREVIOUS}.ckpt") if path.name == f"{LAST}.ckpt" else None


def where_last_is(root_dir: str | Path, dirpath: str | Path | None = None) -> str:
    """The folders :func:`last_checkpoints` searches, for a message."""
    root = Path(root_dir).resolve()
    extra = f" or {Path(dirpath).resolve()}/ (--checkpoint.dirpath)" if dirpath is not None else ""
    return f"{root}/version_*/checkpoints/ or {root}/checkpoints/ (runs with --trainer.logger false){extra}"


def newest_last_of_job(root_dir: str | Path, job: str, job_of: Callable[[Path], str | None]) -> Path | None:
    """The newest ``last.ckpt`` below ``root_dir`` whose torchrun job (``job_of(file)``) is ``job``, or None."""
    return next((p for p in last_checkpoints(root_dir) if job_of(p) == job), None)


def version_of(last: Path) -> str | None:
    """The ``version_N`` a run's ``version_N/checkpoints/last.ckpt`` belongs to (the loggers continue it), or None
    for a ``last.ckpt`` in no version folder (a run without a logger, ``--checkpoint.dirpath``)."""
    version = last.parent.parent.name
    return version if last.parent.name == "checkpoints" and version.startswith("version_") else None


def hpc_checkpoints(root_dir: str | Path) -> list[Path]:
    """The ``hpc_ckpt_N.ckpt`` files Lightning saves at a SLURM preemption in ``root_dir``, highest N first."""
    # the file Lightning's SLURM auto-requeue resumes from (checkpoint_connector._hpc_resume_path)
    numbered = ((re.search(r"_(\d+)\.ckpt$", p.name), p) for p in Path(root_dir).glob("hpc_ckpt_*.ckpt"))
    return [p for _, p in sorted(((int(m.group(1)), p) for m, p in numbered if m), reverse=True)]


def hpc_checkpoint(root_dir: str | Path) -> Path | None:
    """The ``hpc_ckpt_N.ckpt`` Lightning auto-resumes from under SLURM (highest N in ``root_dir``), or None."""
    found = hpc_checkpoints(root_dir)
    return found[0] if found else None


def last_checkpoint_of(trainer: Trainer) -> Path:
    """Where this run writes its ``last.ckpt``: the checkpoint callback's folder, the run folder without one."""
    ckpt = trainer.checkpoint_callback
    folder = Path(ckpt.dirpath if ckpt is not None and ckpt.dirpath else trainer.default_root_dir)
    return folder / f"{getattr(ckpt, 'CHECKPOINT_NAME_LAST', None) or LAST}.ckpt"
