"""Which checkpoint a run resumes from, decided once (:meth:`ResumeSearch.decide`) as one record (:class:`Resume`)
the CLI, the loggers and the preflight plan read. The sources, in the order they are asked:

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
``last.ckpt`` keeps the one before it as ``last.previous.ckpt``, :class:`app.checkpoint.AtomicCheckpointIO`), with
one line naming both. A corrupt file is never deleted: an unattended restart must not fail the same way on every
attempt, and a person may still want to look at it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.checkpoint.identity import RunIdentity, jobs_of, started_by
from app.checkpoint.names import hpc_checkpoints, mtime, resumable_checkpoints, run_folder, unreadable, where_last_is
from app.checkpoint.reading import CheckpointError, Read, Reader
from core.env import Launch
from core.errors import with_link


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
        state: the checkpoint the run loads, read once and checked (on the CPU, its tensors memory-mapped).
        run_folder: a restarted job with nothing saved yet: the ``version_N`` folder its first attempt started,
            which this attempt continues (one run folder per job).
        hparams: the model hyperparameters of ``--ckpt_path FILE``, as LightningCLI applies them (the CLI does).
        reader: the run's reader, which read ``state`` (the run's checkpoint I/O hands Lightning what it read).
        subcommand: the subcommand the record was prepared for (``fit``...).
    """

    path: Path | None
    why: str
    source: From = From.NOTHING
    passed_over: list[tuple[Path, str]] = field(default_factory=list)
    state: dict | None = field(default=None, repr=False)
    run_folder: Path | None = None
    hparams: dict = field(default_factory=dict, repr=False)
    reader: Reader | None = field(default=None, repr=False)
    subcommand: str | None = None

    @property
    def identity(self) -> RunIdentity:
        """The run identity the checkpoint holds (empty without one)."""
        return RunIdentity.of(self.state)

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


class ResumeSearch:
    """Searches a run folder for the checkpoint a run resumes from, reading each candidate once.

    Args:
        default_root_dir: the run folder (``trainer.default_root_dir``).
        dirpath: ``--checkpoint.dirpath``, searched for ``last`` too.
        trust: ``--trust_checkpoint``: read with full unpickling.
    """

    def __init__(
        self, default_root_dir: str | Path | None = None, dirpath: str | Path | None = None, trust: bool = False
    ) -> None:
        self.root, self.dirpath = run_folder(default_root_dir), dirpath
        self.reader = Reader(trust)

    def read(self, path: Path) -> Read:
        """``path`` as read once (:meth:`~app.checkpoint.reading.Reader.read`)."""
        return self.reader.read(path)

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
            return Resume(Path(given), "your --ckpt_path", From.FILE, state=read.state if read else None)
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
        candidates = sorted(hpc + own, key=mtime, reverse=True) if own else hpc
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
                return Resume(path, "", passed_over=passed, state=read.state)
        return Resume(None, "", passed_over=passed)
