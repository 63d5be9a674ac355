"""A SLURM job requeues itself after a fault: ``--launch.max_restarts K`` in any sbatch script with ``--requeue``.

A fault that ends the job step (the hang watch's exit, a lost rank, a lost DataLoader worker, a rendezvous timeout)
calls :meth:`Requeue.after_fault` on its way out. Under SLURM it is recorded in ``<run dir>/faults.jsonl`` (one JSON
line: job, attempt, kind, step, node), and while the job's faults number at most K, one rank of the attempt calls
``scontrol requeue $SLURM_JOB_ID``: SLURM ends the step and puts the job back in the queue, and the requeued attempt
resumes from its newest checkpoint (:meth:`app.checkpoint.Checkpoints.decide`). Past K, one ``error:`` line says so
and the job fails. The budget counts faults, not requeues: ``SLURM_RESTART_COUNT`` also counts the requeues of a
preemption or of the wall time (Lightning's SIGUSR1 path, :mod:`app.resilience.preemption`), which never use it.

The policy is a :class:`Requeue` object owned by the command: :func:`app.command.main` makes it, the CLI arms it for
a fit, the error channel and the hang watch's thread call it. One rank per attempt acts: the first to create
``<run dir>/.requeue-<job>-<count>`` (``O_EXCL``, on the run folder every rank shares), so there is one record, one
``scontrol requeue`` and one line; its record is one ``write`` to a file opened ``O_APPEND``, and no other process
writes there during the attempt. The batch script of ``python -m tools.slurm submit`` requeues by itself (it also
covers a rank that died, whose step srun ends with ``--kill-on-bad-exit``: it records that fault when the app could
not) and tells the app so with ``DPTRAIN_REQUEUE_BY=script`` (:attr:`core.env.Launch.requeue_by_script`); the app
then only records. SLURM's own mechanism (``scontrol requeue``): written here only because neither Lightning (which
requeues on its preemption signal only) nor SLURM requeues a job on a failed step.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from core.env import Launch, node_name
from core.errors import UserError, report, say

FAULTS = "faults.jsonl"  # in the run dir; the batch script of tools.slurm reads and appends it too (tools/sbatch.py)


class RestartsUsedUp(UserError):
    """The fault above ends the job: no restart or requeue is left, or the requeue could not be made."""

    help = "restarts-used-up"


def faults_of(folder: Path, job: str) -> list[dict[str, Any]]:
    """The faults recorded in the run dir ``folder`` for SLURM job ``job``, oldest first."""
    try:
        lines = (Path(folder) / FAULTS).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a full disk
            continue
        if isinstance(record, dict) and str(record.get("job")) == str(job):
            found.append(record)
    return found


def record_fault(folder: Path, job: str, attempt: int, kind: str, step: int | None) -> None:
    """Appends one fault to ``<folder>/faults.jsonl``; the key order is the one the batch script's grep expects."""
    line = json.dumps({"job": str(job), "attempt": attempt, "kind": kind, "step": step, "node": node_name()})
    fd = os.open(Path(folder) / FAULTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: a line of its own even beside the batch script's
    finally:
        os.close(fd)


def counts(faults: int, restart_count: int) -> str:
    """``3 requeues by time or preemption before it``: the requeues the fault budget leaves out (the job's requeues
    so far, less those of its earlier faults), said after the budget's ``fault 1 of 2``."""
    other = max(restart_count - (faults - 1), 0)
    return f"{other} requeue{'' if other == 1 else 's'} by time or preemption before it"


class Requeue:
    """Whether and how this process's SLURM job requeues itself after a fault: disarmed until :meth:`arm`."""

    def __init__(self) -> None:
        self._armed: tuple[int, Path, Launch] | None = None  # (--launch.max_restarts, the run folder, the job)
        self.trainer: Any = None  # the fit's Trainer once built (app.command): the step of a fault

    def arm(self, max_restarts: int, run_folder: Path, launch: Launch) -> None:
        """For a ``fit`` that SLURM launched under ``--launch.max_restarts``: record each fault, and requeue after it
        unless the batch script does."""
        self._armed = (max_restarts, Path(run_folder), launch) if launch.slurm_job and max_restarts > 0 else None

    @property
    def armed(self) -> bool:
        """Whether the app itself requeues (not the batch script)."""
        return self._armed is not None and not self._armed[2].requeue_by_script

    def after_fault(self, fault: object = None) -> None:
        """On a fault's way out: one rank of the attempt records it, then requeues the job while the budget lasts, or
        says it is used up. ``fault``: the :class:`~app.resilience.faults.Fault` (or its kind), named in the record.
        Never raises: the process is exiting anyway."""
        if self._armed is None:
            return
        budget, folder, launch = self._armed
        job, count = launch.slurm_requeue_id, launch.restart_count  # an array's task: ARRAYJOB_TASK, it alone
        try:
            folder.mkdir(parents=True, exist_ok=True)
            os.close(os.open(folder / f".requeue-{job}-{count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return  # another rank of this attempt acts
        except OSError:
            pass  # no shared folder to agree in: act (a second scontrol requeue of the same attempt fails harmlessly)
        kind = getattr(fault, "help", None) or type(fault).__name__ if fault is not None else "fault"
        try:
            record_fault(folder, str(job), count + 1, kind, getattr(self.trainer, "global_step", None))
        except OSError as err:
            say(f"SLURM: the fault could not be recorded in {folder / FAULTS} ({err}); it counts as the first.")
        if not launch.requeue_by_script:
            self._requeue(budget, max(len(faults_of(folder, str(job))), 1), str(job), count)

    def _requeue(self, budget: int, faults: int, job: str, count: int) -> None:
        """Requeues the job as its fault number ``faults`` of ``budget``, or says no requeue is left."""
        if faults > budget:
            report(
                RestartsUsedUp(
                    f"SLURM: the fault above ends job {job} and no requeue is left (fault {faults}, {budget} of "
                    f"{budget} used, --launch.max_restarts; {counts(faults, count)}), so the job fails. Fix: look at "
                    f"the fault's line above (every fault of the job: {FAULTS} in the run dir), then submit again "
                    "with --ckpt_path last."
                )
            )
            return
        # said before scontrol runs: the requeue ends this step at once (SIGTERM to every task, this one included), so
        # a line printed after it returned could be lost; a failed requeue is said by the error line that follows
        say(
            f"SLURM: requeue {count + 1} (scontrol requeue {job}): fault {faults} of {budget} "
            f"(--launch.max_restarts); {counts(faults, count)}. The job goes back in the queue and resumes from its "
            "newest checkpoint. The line above names the node of the fault; keep the job off it with sbatch "
            "--exclude NODE."
        )
        try:
            out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
            failed = out.stderr.strip() or out.stdout.strip() if out.returncode != 0 else None
        except (OSError, subprocess.TimeoutExpired) as err:
            failed = str(err)
        if failed is not None:
            report(
                RestartsUsedUp(
                    f"SLURM: scontrol requeue {job} failed ({failed.splitlines()[0][:200]}), so the job fails. Fix: "
                    "submit with `#SBATCH --requeue` (the cluster may not requeue jobs by default), then again with "
                    "--ckpt_path last."
                )
            )
