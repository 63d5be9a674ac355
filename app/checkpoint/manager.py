"""The front door of a run's checkpoints: where they are, and which one a run resumes from (:class:`Checkpoints`).

The run folder's layout, in one place (nothing else spells these names)::

    <trainer.default_root_dir>/            the run folder (configs: runs/<recipe>); loggers without save_dir write here
        version_N/                         one run: TensorBoard events, config.yaml, summary.json
            checkpoints/last.ckpt          the newest state of that run (``--ckpt_path last``, SIGTERM)
            checkpoints/epoch=...ckpt      the best by val/acc1 (the --checkpoint group)
        checkpoints/last.ckpt              the same for a run without a logger (``--trainer.logger false``)
        hpc_ckpt_N.ckpt                    SLURM's requeue checkpoint (Lightning saves and resumes the highest N)

What a run resumes from is decided once (:meth:`Checkpoints.decide`), as a typed :class:`Resume` the CLI, the loggers
and the preflight plan read. The sources, in the order they are asked:

- ``--ckpt_path FILE``: that file (checked by :meth:`~app.checkpoint.reading.Reader.given`; a corrupt file the user
  named is refused, never replaced by another).
- ``--ckpt_path best|registry`` and URLs: Lightning's to resolve.
- ``--ckpt_path last``: the newest ``last.ckpt`` of the runs in the run folder.
- ``--ckpt_path hpc``, or a fit under SLURM with an ``hpc_ckpt_N.ckpt`` in the run folder: SLURM's requeue checkpoint.
- a requeued SLURM job (``SLURM_RESTART_COUNT`` > 0): also its own newest ``last.ckpt``, when newer than the
  ``hpc_ckpt`` (a requeue after a fault, which saves no ``hpc_ckpt``).
- a restarted torchrun worker group (``TORCHELASTIC_RESTART_COUNT`` > 0, or a job with its own ``--rdzv-id``): the
  newest ``last.ckpt`` whose run identity names this job (``TORCHELASTIC_RUN_ID``).

For the automatic sources (everything but an explicit file), a newest checkpoint that does not read (truncated by a
disk fault, half copied) falls back to the newest one that does, among the same run folder's checkpoints (each
``last.ckpt`` keeps the one before it as ``last.previous.ckpt``, :class:`app.checkpoint.io.AtomicCheckpointIO`), with
one line naming both. A corrupt file is never deleted: an unattended restart must not fail the same way on every
attempt, and a person may still want to look at it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint.identity import RunIdentity, jobs_of, started_by
from app.checkpoint.reading import CheckpointError, Read, Reader
from core.env import Launch
from core.errors import with_link

LAST = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST: the file name of the newest state of a run, without ".ckpt"
PREVIOUS = f"{LAST}.previous"  # the last.ckpt before the newest, kept by each save of a last.ckpt (a fallback)


# --- the run folder's layout -----------------------------------------------------------------------------------------


def root(default_root_dir: str | Path | None) -> Path:
    """The run folder that ``trainer.default_root_dir`` names (the current folder when unset)."""
    return Path(default_root_dir or ".")


def resumable_checkpoints(root_dir: str | Path, dirpath: str | Path | None = None) -> list[Path]:
    """Every checkpoint of the runs below ``root_dir``, newest first (a ``last.ckpt`` before any other file of the
    same age): the newest ``last.ckpt``, then what a resume falls back to when it does not read
    (``last.previous.ckpt``, the best checkpoints, earlier runs). A run with a logger saves in
    ``version_N/checkpoints/``, one without (``--trainer.logger false``: Lightning's ModelCheckpoint then saves in the
    run folder itself) in ``checkpoints/``; ``dirpath`` (``--checkpoint.dirpath``) is searched too when set."""
    found = _glob(Path(root_dir), dirpath, "*.ckpt")
    return sorted(found, key=lambda p: (_mtime(p), p.name == f"{LAST}.ckpt"), reverse=True)


def _mtime(path: Path) -> float:
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


# --- the decision ------------------------------------------------------------------------------------------------


class From(enum.Enum):
    """Where the checkpoint a run resumes from comes from."""

    NOTHING = "nothing"  # a fresh start (or validate/test/predict without --ckpt_path)
    FILE = "file"  # --ckpt_path FILE
    LIGHTNING = "lightning"  # --ckpt_path best|registry or a URL: Lightning resolves it
    LAST = "last"  # --ckpt_path last
    HPC = "hpc"  # SLURM's requeue checkpoint (hpc_ckpt_N.ckpt)
    SLURM = "slurm"  # a requeued SLURM job's own newest checkpoint
    TORCHRUN = "torchrun"  # a restarted torchrun worker group's newest last.ckpt

    @property
    def found_here(self) -> bool:
        """The run folder's checkpoints were searched (the name ``last``/``hpc``, a restart or a requeue)."""
        return self in (From.LAST, From.HPC, From.SLURM, From.TORCHRUN)


@dataclass
class Resume:
    """The decision: the checkpoint file (None: a fresh start, or a name Lightning resolves) and why.

    Attributes:
        path: the file the run resumes from, or None.
        why: the reason, as the plan's ``resume from`` line shows it.
        source: where it comes from.
        passed_over: newer checkpoints of the same source that do not read, each with torch's reason.
        read: ``path`` as read (on the CPU, memory-mapped), when it was read here.
        run_folder: a restarted job with nothing saved yet: the ``version_N`` folder its first attempt started,
            which this attempt continues (one run folder per job).
    """

    path: Path | None
    why: str
    source: From = From.NOTHING
    passed_over: list[tuple[Path, str]] = field(default_factory=list)
    read: Read | None = field(default=None, repr=False)
    run_folder: Path | None = None

    @property
    def checkpoint(self) -> dict | None:
        """The checkpoint's state on the CPU (its tensors memory-mapped), when it was read."""
        return self.read.state if self.read is not None else None

    @property
    def identity(self) -> RunIdentity:
        """The run identity the checkpoint holds (empty without one)."""
        return RunIdentity.of(self.checkpoint)

    def describe(self) -> str:
        """The plan's ``resume from`` value."""
        if self.source is From.HPC and self.path is not None:
            return f"hpc: {self.path} ({self.why})"
        return f"{self.path} ({self.why})" if self.path is not None else self.why

    def fallback_line(self) -> str | None:
        """One line when newer checkpoints were passed over because they do not read, else None."""
        if not self.passed_over:
            return None
        bad = "; ".join(f"{path} ({reason})" for path, reason in self.passed_over)
        kept = ", ".join(unreadable(path).name for path, _ in self.passed_over)
        target = f"resuming from {self.path}, the newest that reads" if self.path else "starting from scratch"
        return with_link(
            f"warning: resume: {bad} does not read (truncated or corrupt; kept as {kept}); {target}. "
            "Fix: nothing to do for this run; check the disk that holds the run folder.",
            "checkpoint-corrupt",
        )

    def _said(self, source: From, why: str, none: str) -> Resume:
        self.source, self.why = source, (why if self.path is not None else none)
        return self


class Checkpoints:
    """A run's checkpoints: the one object the CLI, the loggers and the preflight ask where they are, what each holds
    (each file read at most once: :class:`~app.checkpoint.reading.Reader`) and which one the run resumes from.

    Args:
        default_root_dir: the run folder (``trainer.default_root_dir``).
        dirpath: ``--checkpoint.dirpath``, searched for ``last`` too.
        trust: ``--trust_checkpoint``: read with full unpickling.
    """

    def __init__(
        self, default_root_dir: str | Path | None = None, dirpath: str | Path | None = None, trust: bool = False
    ) -> None:
        self.root, self.dirpath = root(default_root_dir), dirpath
        self.reader = Reader(trust)

    @classmethod
    def of(cls, config: Any) -> Checkpoints:
        """The checkpoints of the run a parsed subcommand config describes."""
        dirpath = (config.get("checkpoint") or {}).get("dirpath")
        return cls(config.trainer.get("default_root_dir"), dirpath, bool(config.get("trust_checkpoint")))

    def read(self, path: Path) -> Read:
        """``path`` as read once (:meth:`~app.checkpoint.reading.Reader.read`)."""
        return self.reader.read(path)

    def given(self, path: str | Path) -> dict:
        """``--ckpt_path FILE`` read and checked (:meth:`~app.checkpoint.reading.Reader.given`)."""
        return self.reader.given(path)

    def apply(self, config: Any, subcommand: str | None, launch: Launch) -> Resume:
        """:meth:`decide` for ``config.ckpt_path``, then ``config.ckpt_path`` set to the file it found in the run
        folder (None for a fresh start); rank 0 says what it chose and moves the files passed over out of the way."""
        decision = self.decide(config.get("ckpt_path"), subcommand, launch)
        self.reader.keep_only(decision.path)  # the files passed over are not held open for the whole run
        if decision.run_folder is not None:
            rank_zero_info(f"resume: {decision.why}")
        if not decision.source.found_here:  # a file or name given, or nothing to resume
            return decision
        config.ckpt_path = str(decision.path) if decision.path is not None else None
        if line := decision.fallback_line():
            rank_zero_info(line)
            if launch.rank == 0:  # out of the way of this run's saves (a new last.ckpt would replace it), never deleted
                for path, _ in decision.passed_over:
                    with contextlib.suppress(OSError):
                        os.replace(path, unreadable(path))
        if decision.path is not None:
            rank_zero_info(f"resume: {decision.describe()}")
        elif decision.source is From.LAST:
            rank_zero_info(f"{decision.why}; starting from scratch.")
        return decision

    def decide(self, given: str | None, subcommand: str | None, launch: Launch) -> Resume:
        """The checkpoint this run resumes from, and why. Reads checkpoint files; changes nothing.

        Raises:
            CheckpointError: ``--ckpt_path last`` outside ``fit`` with no checkpoint in the run folder.
        """
        if given and given not in ("last", "hpc"):
            if given in ("best", "registry") or "://" in str(given):
                return Resume(None, f"{given} (Lightning resolves it)", From.LIGHTNING)
            if subcommand == "fit" and launch.restart_count > 0:  # a restart continues its job's newer save
                own = self._slurm(launch) if launch.launcher == "slurm" else self._torchrun(launch)
                if own is not None and own.path is not None:
                    return own
            read = self.read(Path(given)) if Path(given).is_file() else None
            return Resume(Path(given), "your --ckpt_path", From.FILE, read=read)
        if given == "last":
            where = where_last_is(self.root, self.dirpath)
            found = self._newest_readable(resumable_checkpoints(self.root, self.dirpath))
            if found.path is None and subcommand != "fit":
                raise CheckpointError(
                    f"--ckpt_path last: no checkpoint found in {where}. Train first with `python cli.py fit` (same "
                    "--trainer.default_root_dir), or pass --ckpt_path FILE.",
                    help="checkpoint-last-missing",
                )
            return found._said(
                From.LAST, "--ckpt_path last: the newest last.ckpt", f"--ckpt_path last: no last.ckpt in {where} yet"
            )
        if subcommand != "fit":
            return Resume(None, "nothing")
        if given == "hpc" or launch.launcher == "slurm":
            found = self._slurm(launch)
            found = found if found is not None else Resume(None, "nothing (fresh start)")
            return self._continuing(found, launch, "slurm_job")
        found = self._torchrun(launch)
        if found is None:
            return Resume(None, "nothing (fresh start)")
        return self._continuing(found, launch, "torchrun_job")

    def _torchrun(self, launch: Launch) -> Resume | None:
        """torchrun: the job's own newest checkpoint (its identity names the job). None: not a torchrun job that
        resumes (torchrun gives every job without --rdzv-id the id "none": such a job resumes only once restarted)."""
        job = launch.torchrun_job
        if launch.launcher != "torchrun" or not job or (job == "none" and launch.restart_count == 0):
            return None
        mine = resumable_checkpoints(self.root, self.dirpath)  # read newest first until one is this job's
        found = self._newest_readable(mine, lambda read: read.identity.torchrun_job == job)
        why = f"torchrun restart {launch.restart_count}: the newest last.ckpt of job {job}"
        return found._said(From.TORCHRUN, why, "nothing (fresh start)")

    def _slurm(self, launch: Launch) -> Resume | None:
        """SLURM: the ``hpc_ckpt_N.ckpt`` Lightning saves at a preemption; a requeued job (``SLURM_RESTART_COUNT`` > 0,
        after a preemption or a fault) also its own newest ``last.ckpt`` (its identity names this job), whichever is
        newer. None: nothing to resume."""
        hpc, job = hpc_checkpoints(self.root), launch.slurm_job
        requeued = launch.launcher == "slurm" and launch.restart_count > 0 and bool(job)
        own: list[Path] = []  # a requeued job's own checkpoints (only such a job reads them)
        if requeued:  # read newest first until one is this job's
            own = resumable_checkpoints(self.root, self.dirpath)
        if not hpc and not own:
            return None
        # Lightning's order for its hpc_ckpt files is the highest N; a requeued job's own files join them by age
        candidates = sorted(hpc + own, key=_mtime, reverse=True) if own else hpc
        found = self._newest_readable(candidates, lambda read: read.path in hpc or read.identity.slurm_job == job)
        if found.path is not None and found.path in hpc:
            return found._said(From.HPC, "SLURM's requeue checkpoint (Lightning saves it at preemption)", "nothing")
        why = f"SLURM requeue {launch.restart_count}: the newest checkpoint of job {job}"
        return found._said(From.SLURM, why, "nothing (fresh start)")

    def _continuing(self, found: Resume, launch: Launch, key: str) -> Resume:
        """A restarted or requeued job with no checkpoint yet (its first attempt failed before one was saved)
        continues the run folder that attempt started: the newest ``version_N`` without checkpoints whose
        ``hparams.yaml`` names this job (:func:`~app.checkpoint.identity.started_by`)."""
        job = jobs_of(launch)[key]
        if found.path is not None or launch.restart_count == 0 or not job:
            return found
        for folder in sorted(self.root.glob("version_*"), key=lambda p: p.stat().st_mtime, reverse=True):
            if not any(folder.glob("checkpoints/*.ckpt")) and started_by(folder).get(key) == job:
                found.run_folder = folder
                found.why = f"nothing saved yet; continuing {folder.name}, which this job started"
                return found
        return found

    def _newest_readable(self, candidates: list[Path], wanted: Callable[[Read], bool] = lambda read: True) -> Resume:
        """The first of ``candidates`` (newest first) that reads and that ``wanted`` accepts; those that do not read
        are passed over, with the reason."""
        passed: list[tuple[Path, str]] = []
        for path in candidates:
            read = self.read(path)
            if read.holds_code:  # pickled code, not a damaged file: the Trainer's load refuses it, naming the fix
                return Resume(path, "", passed_over=passed)
            if read.state is None:
                passed.append((path, read.problem or "does not read"))
            elif wanted(read):
                return Resume(path, "", passed_over=passed, read=read)
        return Resume(None, "", passed_over=passed)
