"""A SLURM job requeues itself after a fault: ``--launch.max_restarts K`` in any sbatch script with ``--requeue``.

A fault that ends the job step (the hang watch's exit, a lost rank, a lost DataLoader worker) calls
:func:`after_fault` on its way out. Under SLURM, while fewer than K requeues were made (``SLURM_RESTART_COUNT``),
one rank of the attempt calls ``scontrol requeue $SLURM_JOB_ID``: SLURM ends the step and puts the job back in the
queue, and the requeued attempt resumes from its newest checkpoint (:mod:`app.resume`). With no requeue left, one
``error:`` line says so and the job fails.

One rank per attempt acts: the first to create ``<run dir>/.requeue-<job>-<count>`` (``O_EXCL``, on the run folder
every rank shares), so there is one ``scontrol requeue`` and one line. The batch script of ``python -m tools.slurm
submit`` requeues by itself (it also covers a rank that died, whose step srun ends with ``--kill-on-bad-exit``)
and tells the app so with ``DPTRAIN_REQUEUE_BY=script``; the app then leaves it to the script. SLURM's own mechanism
(``scontrol requeue``): written here only because neither Lightning (which requeues on its preemption signal only)
nor SLURM requeues a job on a failed step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from core.errors import say, with_link

SCRIPT_OWNS = "DPTRAIN_REQUEUE_BY"  # set to "script" by the batch script of tools.slurm submit
_armed: tuple[int, Path] | None = None  # (--launch.max_restarts, the run folder) of this fit under SLURM


def arm(max_restarts: int, run_folder: Path) -> None:
    """Called by the CLI for a ``fit`` that SLURM launched: requeue after a fault, unless the batch script does."""
    global _armed
    mine = bool(os.environ.get("SLURM_JOB_ID")) and os.environ.get(SCRIPT_OWNS) != "script"
    _armed = (max_restarts, Path(run_folder)) if mine and max_restarts > 0 else None


def armed() -> bool:
    return _armed is not None


def after_fault() -> None:
    """On a fault's way out: one rank of the attempt requeues the job while the budget lasts, or says it is used up.
    Never raises: the process is exiting anyway."""
    if _armed is None:
        return
    budget, folder = _armed
    job, count = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(folder / f".requeue-{job}-{count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return  # another rank of this attempt acts
    except OSError:
        pass  # no shared folder to agree in: act (a second scontrol requeue of the same attempt fails harmlessly)
    if count >= budget:
        say(
            with_link(
                f"error: SLURM: the fault above ends job {job} and no requeue is left ({count} of {budget} used, "
                "--launch.max_restarts), so the job fails. Fix: look at the fault's line above, then submit again "
                "with --ckpt_path last.",
                "restarts-used-up",
            )
        )
        return
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        failed = out.stderr.strip() or out.stdout.strip() if out.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as err:
        failed = str(err)
    if failed is None:
        say(
            f"SLURM: requeue {count + 1} of {budget} (scontrol requeue {job}, --launch.max_restarts): the job goes "
            "back in the queue and resumes from its newest checkpoint. The line above names the node of the fault; "
            "keep the job off it with sbatch --exclude NODE."
        )
    else:
        say(
            with_link(
                f"error: SLURM: scontrol requeue {job} failed ({failed.splitlines()[0][:200]}), so the job fails. "
                "Fix: submit with `#SBATCH --requeue` (the cluster may not requeue jobs by default), then again with "
                "--ckpt_path last.",
                "restarts-used-up",
            )
        )
