"""A SLURM job requeues itself after a fault: ``--launch.max_restarts K`` in any sbatch script with ``--requeue``.

A fault that ends the job step (the hang watch's exit, a lost rank, a lost DataLoader worker, a rendezvous timeout)
calls :meth:`Requeue.after_fault` on its way out. Under SLURM, while fewer than K requeues were made
(``SLURM_RESTART_COUNT``), one rank of the attempt calls ``scontrol requeue $SLURM_JOB_ID``: SLURM ends the step and
puts the job back in the queue, and the requeued attempt resumes from its newest checkpoint
(:meth:`app.checkpoint.Checkpoints.decide`). With no requeue left, one ``error:`` line says so and the job fails.

The policy is a :class:`Requeue` object owned by the command: :func:`app.command.main` makes it, the CLI arms it for
a fit, the error channel and the hang watch's thread call it. One rank per attempt acts: the first to create
``<run dir>/.requeue-<job>-<count>`` (``O_EXCL``, on the run folder every rank shares), so there is one ``scontrol
requeue`` and one line. The batch script of ``python -m tools.slurm submit`` requeues by itself (it also covers a rank
that died, whose step srun ends with ``--kill-on-bad-exit``) and tells the app so with ``DPTRAIN_REQUEUE_BY=script``
(:attr:`core.env.Launch.requeue_by_script`); the app then leaves it to the script. SLURM's own mechanism (``scontrol
requeue``): written here only because neither Lightning (which requeues on its preemption signal only) nor SLURM
requeues a job on a failed step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from core.env import Launch
from core.errors import UserError, report, say


class RestartsUsedUp(UserError):
    """The fault above ends the job: no restart or requeue is left, or the requeue could not be made."""

    help = "restarts-used-up"


class Requeue:
    """Whether and how this process's SLURM job requeues itself after a fault: disarmed until :meth:`arm`."""

    def __init__(self) -> None:
        self._armed: tuple[int, Path, Launch] | None = None  # (--launch.max_restarts, the run folder, the job)

    def arm(self, max_restarts: int, run_folder: Path, launch: Launch) -> None:
        """For a ``fit`` that SLURM launched: requeue after a fault, unless the batch script does."""
        mine = bool(launch.slurm_job) and not launch.requeue_by_script
        self._armed = (max_restarts, Path(run_folder), launch) if mine and max_restarts > 0 else None

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def after_fault(self) -> None:
        """On a fault's way out: one rank of the attempt requeues the job while the budget lasts, or says it is used
        up. Never raises: the process is exiting anyway."""
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
        if count >= budget:
            report(
                RestartsUsedUp(
                    f"SLURM: the fault above ends job {job} and no requeue is left ({count} of {budget} used, "
                    "--launch.max_restarts), so the job fails. Fix: look at the fault's line above, then submit "
                    "again with --ckpt_path last."
                )
            )
            return
        # said before scontrol runs: the requeue ends this step at once (SIGTERM to every task, this one included), so
        # a line printed after it returned could be lost; a failed requeue is said by the error line that follows
        say(
            f"SLURM: requeue {count + 1} of {budget} (scontrol requeue {job}, --launch.max_restarts): the job goes "
            "back in the queue and resumes from its newest checkpoint. The line above names the node of the "
            "fault; keep the job off it with sbatch --exclude NODE."
        )
        try:
            out = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
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
