"""What a run resumes from, decided once: the CLI, the loggers and the preflight plan ask :func:`decide`.

The sources, in the order they are asked:

- ``--ckpt_path FILE``: that file (checked by :func:`app.checkpoint.read_given_checkpoint`; a corrupt file the user
  named is refused, never replaced by another).
- ``--ckpt_path best|registry`` and URLs: Lightning's to resolve.
- ``--ckpt_path last``: the newest ``last.ckpt`` of the runs in the run folder (:mod:`app.run_dir`).
- ``--ckpt_path hpc``, or a fit under SLURM with an ``hpc_ckpt_N.ckpt`` in the run folder: SLURM's requeue checkpoint.
- a requeued SLURM job (``SLURM_RESTART_COUNT`` > 0): also its own newest ``last.ckpt``, when newer than the
  ``hpc_ckpt`` (a requeue after a fault, which saves no ``hpc_ckpt``).
- a restarted torchrun worker group (``TORCHELASTIC_RESTART_COUNT`` > 0, or a job with its own ``--rdzv-id``): the
  newest ``last.ckpt`` whose run identity names this job (``TORCHELASTIC_RUN_ID``).

For the automatic sources (everything but an explicit file), a newest checkpoint that does not read (truncated by a
disk fault, half copied) falls back to the newest one that does, among the same run folder's checkpoints (each
``last.ckpt`` keeps the one before it as ``last.previous.ckpt``, :class:`app.checkpoint.AtomicCheckpointIO`), with one
line naming both. A corrupt file is never deleted: an unattended restart must not fail the same way on every attempt,
and a person may still want to look at it.

:class:`ChangedSettings` compares a resumed checkpoint's saved configuration with this run's and applies the
optimizer and scheduler hyperparameters the user changed to the restored state.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from app import run_dir
from app.checkpoint import CheckpointError, checksum_problem, load_on_cpu, readable_copy
from core.env import Launch
from core.errors import with_link

IDENTITY = "TrackingConfigCallback"  # the callback whose checkpoint state is the run's identity and configuration


@dataclass
class Resume:
    """The decision: the checkpoint file (None: a fresh start, or a name Lightning resolves) and why.

    Attributes:
        path: the file the run resumes from, or None.
        why: the reason, as the plan's ``resume from`` line shows it.
        source: ``file``, ``last``, ``hpc``, ``torchrun``, ``slurm`` (a requeued job's own ``last.ckpt``),
            ``lightning`` (a name Lightning resolves) or ``none``.
        passed_over: newer checkpoints of the same source that do not read, each with torch's reason.
        checkpoint: ``path`` loaded on the CPU, memory-mapped (its tensors are not read), when it was read here.
        run_folder: a restarted job with nothing saved yet: the ``version_N`` folder its first attempt started,
            which this attempt continues (one run folder per job).
    """

    path: Path | None
    why: str
    source: str = "none"
    passed_over: list[tuple[Path, str]] = field(default_factory=list)
    checkpoint: dict | None = field(default=None, repr=False)
    run_folder: Path | None = None

    def describe(self) -> str:
        """The plan's ``resume from`` value."""
        if self.source == "hpc" and self.path is not None:  # the preflight's SLURM check reads this prefix
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


def decide(config: Any, subcommand: str | None, launch: Launch) -> Resume:
    """The checkpoint this run resumes from, and why. Reads checkpoint files; changes nothing.

    Raises:
        CheckpointError: ``--ckpt_path last`` outside ``fit`` with no checkpoint in the run folder.
    """
    given = config.get("ckpt_path")
    root = run_dir.root(config.trainer.get("default_root_dir"))
    trust = bool(config.get("trust_checkpoint"))
    if given and given not in ("last", "hpc"):
        if given in ("best", "registry") or "://" in str(given):
            return Resume(None, f"{given} (Lightning resolves it)", "lightning")
        return Resume(Path(given), "your --ckpt_path", "file")
    if given == "last":
        dirpath = (config.get("checkpoint") or {}).get("dirpath")
        found = _newest_readable(run_dir.resumable_checkpoints(root, dirpath), trust)
        if found.path is None and subcommand != "fit":
            raise CheckpointError(
                with_link(
                    f"error: --ckpt_path last: no checkpoint found in {run_dir.where_last_is(root, dirpath)}. "
                    "Train first with `python cli.py fit` (same --trainer.default_root_dir), or pass --ckpt_path FILE.",
                    "checkpoint-last-missing",
                )
            )
        where = run_dir.where_last_is(root, dirpath)
        return _said(
            found, "last", "--ckpt_path last: the newest last.ckpt", f"--ckpt_path last: no last.ckpt in {where} yet"
        )
    if subcommand != "fit":
        return Resume(None, "nothing")
    if given == "hpc" or launch.launcher == "slurm":
        found = _slurm(root, launch, trust)
        if found is not None:
            return found
        return _continuing(Resume(None, "nothing (fresh start)"), root, launch, "slurm_job_id")
    job = launch.job_id
    if launch.launcher == "torchrun" and job and not (job == "none" and launch.restart_count == 0):
        # torchrun gives every job without --rdzv-id the id "none": such a job resumes only once it has restarted
        of_job = [p for p in run_dir.resumable_checkpoints(root) if _job_of(p, "torchrun_job") in (job, None)]
        found = _newest_readable(of_job, trust, lambda path, state: _identity(state).get("torchrun_job") == job)
        why = f"torchrun restart {launch.restart_count}: the newest last.ckpt of job {job}"
        return _continuing(_said(found, "torchrun", why, "nothing (fresh start)"), root, launch, "torchrun_job")
    return Resume(None, "nothing (fresh start)")


def _continuing(found: Resume, root: Path, launch: Launch, key: str) -> Resume:
    """A restarted or requeued job with no checkpoint yet (its first attempt failed before one was saved) continues
    the run folder that attempt started: the newest ``version_N`` without checkpoints whose ``hparams.yaml`` names
    this job (``env.<key>``, :func:`app.loggers.environment`)."""
    if found.path is not None or launch.restart_count == 0 or not launch.job_id:
        return found
    for folder in sorted(root.glob("version_*"), key=lambda p: p.stat().st_mtime, reverse=True):
        if any(folder.glob("checkpoints/*.ckpt")):
            continue
        try:
            env = (yaml.safe_load((folder / "hparams.yaml").read_text()) or {}).get("env") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if str(env.get(key)) == launch.job_id:
            found.run_folder, found.why = folder, f"nothing saved yet; continuing {folder.name}, which this job started"
            return found
    return found


def _slurm(root: Path, launch: Launch, trust: bool) -> Resume | None:
    """SLURM: the ``hpc_ckpt_N.ckpt`` Lightning saves at a preemption; a requeued job (``SLURM_RESTART_COUNT`` > 0,
    after a preemption or a fault) also its own newest ``last.ckpt`` (its identity names this job), whichever is
    newer. None: nothing to resume."""
    hpc = run_dir.hpc_checkpoints(root)
    job, requeued = launch.job_id, launch.launcher == "slurm" and launch.restart_count > 0 and bool(launch.job_id)
    own = [p for p in run_dir.resumable_checkpoints(root) if _job_of(p, "slurm_job") in (job, None)] if requeued else []
    if not hpc and not own:
        return None
    # Lightning's order for its hpc_ckpt files is the highest N; a requeued job's own files join them by age
    candidates = sorted(hpc + own, key=lambda p: p.stat().st_mtime, reverse=True) if own else hpc
    found = _newest_readable(candidates, trust, lambda p, state: p in hpc or _identity(state).get("slurm_job") == job)
    if found.path is not None and found.path in hpc:
        return _said(found, "hpc", "SLURM's requeue checkpoint (Lightning saves it at preemption)", "nothing")
    why = f"SLURM requeue {launch.restart_count}: the newest checkpoint of job {job}"
    return _said(found, "slurm", why, "nothing (fresh start)")


def apply(config: Any, subcommand: str | None, launch: Launch) -> Resume:
    """:func:`decide`, then ``config.ckpt_path`` set to its file (None for a fresh start); rank 0 says what it chose."""
    decision = decide(config, subcommand, launch)
    if decision.run_folder is not None:
        rank_zero_info(f"resume: {decision.why}")
    if decision.source not in ("last", "hpc", "torchrun", "slurm"):  # a file or name given, or nothing to resume
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
    elif decision.source == "last":
        rank_zero_info(f"{decision.why}; starting from scratch.")
    return decision


def unreadable(path: Path) -> Path:
    """Where a checkpoint that does not read is kept once a resume passed it over (no longer a ``.ckpt``)."""
    return path.with_name(f"{path.name}.unreadable")


def _said(found: Resume, source: str, why: str, none: str) -> Resume:
    found.source, found.why = source, (why if found.path is not None else none)
    return found


def _newest_readable(candidates: list[Path], trust: bool, wanted=lambda path, state: True) -> Resume:
    """The first of ``candidates`` (newest first) that reads and that ``wanted`` accepts; those that do not read are
    passed over, with torch's reason."""
    passed: list[tuple[Path, str]] = []
    for path in candidates:
        source = readable_copy(path)  # the node-local copy when it holds the same bytes
        if problem := checksum_problem(source):  # bytes changed since the save: truncated or flipped
            passed.append((path, problem))
            continue
        try:
            state = load_on_cpu(source, weights_only=not trust)
        except pickle.UnpicklingError as err:
            if "GLOBAL" in str(err):  # pickled code, not a damaged file: the Trainer's load refuses it, naming the fix
                return Resume(path, "", passed_over=passed)
            passed.append((path, _reason(err)))
            continue
        except Exception as err:  # zip/pickle/OS errors: truncated or corrupt
            passed.append((path, _reason(err)))
            continue
        if wanted(path, state):
            return Resume(path, "", passed_over=passed, checkpoint=state)
    return Resume(None, "", passed_over=passed)


def _reason(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {(lines[-1] if lines else '')[:120]}"


def _identity(state: dict) -> dict:
    return dict((state.get("callbacks") or {}).get(IDENTITY) or {})


def _job_of(path: Path, key: str) -> str | None:
    """The job (``torchrun_job``, ``slurm_job``) that saved a checkpoint, or None when it does not read (it stays a
    candidate, to be passed over)."""
    try:
        return _identity(load_on_cpu(path)).get(key, "")
    except Exception:
        return None


# --- settings changed on resume ------------------------------------------------------------------------------------

# settings that differ on every resume and mean nothing then
_NOT_COMPARED = ("ckpt_path", "config", "trainer.logger", "test_after_fit", "stacks_on")
# the optimizer's own hyperparameters live in its param groups, restored from the checkpoint; these are applied back
_OPTIMIZER = "model.optimizer.init_args."
_SCHEDULER = "model.lr_scheduler.init_args."
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # scaled together by a changed lr (OneCycleLR keeps all four)


def flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """The settings whose value differs between a checkpoint's run (``saved``) and this one: ``{key: (old, new)}``."""
    old, new = flat(saved), flat(current)
    keys = [k for k in {**old, **new} if not k.startswith(_NOT_COMPARED)]
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


class ChangedSettings(Callback):
    """A resumed fit whose configuration differs from its checkpoint's: one block lists the differences, and the
    optimizer and scheduler hyperparameters among them are applied to the restored state.

    Lightning restores the optimizer's param groups (lr, momentum, weight decay...) and the scheduler's state from
    the checkpoint, so a run resumed with ``--model.optimizer.init_args.lr 0.0123`` would train on with the saved lr
    and say nothing. A changed lr rescales the restored one (``lr``, ``initial_lr`` and the scheduler's ``base_lrs``):
    the schedule goes on from where it was, at the new scale. Other changes (epochs, logging, data workers) are
    honoured by the run itself; a changed network or data layout is refused before this (:mod:`app.checkpoint`).
    """

    def __init__(self, saved: dict | None, current: dict) -> None:
        self.changes = differences(saved, current) if saved is not None else {}
        self.saved_known = saved is not None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.saved_known:
            rank_zero_info("resume: the checkpoint holds no saved configuration (an older version wrote it): "
                           "settings not compared")  # fmt: skip
            return
        if not self.changes:
            return
        applied = self._apply(trainer)
        lines = [f"resume: {len(self.changes)} setting(s) differ from the checkpoint's run:"]
        for key, (old, new) in self.changes.items():
            note = applied.get(key, "")
            lines.append(f"  {key}: {old} -> {new}{note}")
        rank_zero_info("\n".join(lines))

    def _apply(self, trainer: Trainer) -> dict[str, str]:
        """Applies the changed optimizer and scheduler hyperparameters; ``{key: what was done}``."""
        done: dict[str, str] = {}
        for key, (old, new) in self.changes.items():
            if key == f"{_OPTIMIZER}lr" and _number(old) and _number(new) and old:
                done[key] = _rescale_lr(trainer, old, new)
            elif key.startswith(_OPTIMIZER):
                done[key] = _set_in_param_groups(trainer, key[len(_OPTIMIZER) :], new)
            elif key.startswith(_SCHEDULER):
                done[key] = _set_on_schedulers(trainer, key[len(_SCHEDULER) :], new)
        return {k: v for k, v in done.items() if v}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rescale_lr(trainer: Trainer, old: float, new: float) -> str:
    """The restored lr (and the schedule's start values) at ``new / old`` of what they were."""
    was = now = None
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            was = group["lr"] if was is None else was
            for k in _LR_KEYS:
                if k in group:
                    group[k] = _rescaled(group[k], old, new)
            now = group["lr"] if now is None else now
    for config in trainer.lr_scheduler_configs:
        if getattr(config.scheduler, "base_lrs", None) is not None:
            config.scheduler.base_lrs = [_rescaled(b, old, new) for b in config.scheduler.base_lrs]
    return f" (applied: the restored lr {was:.4g} -> {now:.4g} from your settings)" if was is not None else ""


def _set_in_param_groups(trainer: Trainer, name: str, new: Any) -> str:
    """An optimizer hyperparameter (momentum, weight_decay, betas...) set in every restored param group."""
    groups = [g for optimizer in trainer.optimizers for g in optimizer.param_groups if name in g]
    for group in groups:
        group[name] = tuple(new) if isinstance(new, list) else new
    return " (applied to the restored optimizer)" if groups else ""


def _set_on_schedulers(trainer: Trainer, name: str, new: Any) -> str:
    """A scheduler hyperparameter (total_iters, gamma...) set on every restored scheduler that has it."""
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if hasattr(c.scheduler, name)]
    for scheduler in schedulers:
        setattr(scheduler, name, new)
    return " (applied to the restored scheduler)" if schedulers else ""


def _rescaled(value: float, old: float, new: float) -> float:
    """``value`` of a schedule that started at ``old``, for one that starts at ``new`` (``new`` itself at the start)."""
    return new if math.isclose(value, old) else value * new / old


def saved_configuration(checkpoint: dict | None) -> dict | None:
    """The configuration the checkpoint's run was started with (stored by the CLI's config callback), or None."""
    text = _identity(checkpoint or {}).get("config")
    return yaml.safe_load(text) if isinstance(text, str) else None
