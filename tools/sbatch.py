"""The sbatch script of a ``cli.py`` command: :class:`Job` renders it, :func:`submit` submits it.

The command ``python -m tools.slurm submit ...`` runs :mod:`tools.slurm`, which parses the command line with the
app's CLI (so it stands above it) and builds the :class:`Job`. The script follows Lightning's SLURM
contract: ``--ntasks-per-node`` = devices, ``--nodes`` = ``num_nodes``, ``srun python cli.py``, ``--signal=SIGUSR1@90``
and ``--requeue`` (Lightning saves ``hpc_ckpt_N.ckpt`` on the signal, requeues the job and resumes from it), with a
run directory that stays the same across requeues.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import with_link

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    """What the sbatch script asks for; ``command`` is the ``cli.py`` command line (subcommand first)."""

    command: list[str]
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    run_dir: str = "runs"
    job_name: str = "dptrain"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    signal_seconds: int = 90
    max_restarts: int = 0  # --launch.max_restarts of the command: requeues after a failed step
    sbatch_lines: list[str] = field(default_factory=list)
    setup_lines: list[str] = field(default_factory=list)
    python: str = sys.executable
    chdir: str = "."
    grid: list[tuple[str, list[str]]] = field(default_factory=list)  # --grid KEY=V1,V2: one array task per combination
    max_parallel: int = 0  # --max-parallel P: at most P array tasks at a time (0: as many as SLURM runs)

    @property
    def accelerator(self) -> str:
        return "gpu" if self.gpus_per_node else "cpu"

    def cli_args(self, with_run_dir: bool = True) -> list[str]:
        """The user's command with the layout appended (later flags win in LightningCLI)."""
        layout = ["--trainer.num_nodes", str(self.nodes), "--trainer.devices", str(self.tasks_per_node)]
        layout += ["--trainer.accelerator", self.accelerator]
        return [*self.command, *layout, *(("--trainer.default_root_dir", self.run_dir) if with_run_dir else ())]

    def tasks(self) -> list[tuple[str, list[str]]]:
        """The grid's array tasks in task-id order (the cartesian product, the last key changing fastest): each
        task's run folder name (``lr=0.1,batch_size=64``) and the options it appends to the command."""
        keys = [key for key, _ in self.grid]
        short = [key.rsplit(".", 1)[-1] for key in keys]
        names = short if len(set(short)) == len(short) else keys  # the last part of each key, unless two share it
        tasks = []
        for values in itertools.product(*(values for _, values in self.grid)):
            folder = ",".join(f"{name}={value}" for name, value in zip(names, values, strict=True))
            args = [arg for key, value in zip(keys, values, strict=True) for arg in (f"--{key}", value)]
            tasks.append((re.sub(r"[^\w.=,+-]", "_", folder), args))
        if len({folder for folder, _ in tasks}) < len(tasks):  # values that differ only in what was replaced by _
            tasks = [(f"{i}-{folder}", args) for i, (folder, args) in enumerate(tasks)]
        return tasks

    @property
    def job_ref(self) -> str:
        """The job ``scontrol`` shows and requeues: ``ARRAYJOB_TASK`` for a grid's task, whose own ``SLURM_JOB_ID``
        may be the array's (one task's is, and ``scontrol`` takes that id for every task of the array)."""
        return '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' if self.grid else '"$SLURM_JOB_ID"'

    def _array_lines(self) -> list[str]:
        """The case that picks array task ``$SLURM_ARRAY_TASK_ID``'s values and run folder."""
        lines = ['case "$SLURM_ARRAY_TASK_ID" in']
        for i, (folder, args) in enumerate(self.tasks()):
            task = [*args, "--trainer.default_root_dir", f"{self.run_dir}/{folder}"]
            lines.append(f"  {i}) task=({shlex.join(task)}) ;;")
        lines += [
            '  *) echo "error: array task $SLURM_ARRAY_TASK_ID is not in this grid"; exit 2 ;;',
            "esac",
            'echo "array task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID: ${task[*]}"',
        ]
        return lines

    def render(self) -> str:
        """The sbatch script."""
        count = len(self.tasks()) if self.grid else 0
        options = {
            "job-name": self.job_name,
            "nodes": self.nodes,
            "ntasks-per-node": self.tasks_per_node,
            "gpus-per-node": self.gpus_per_node or None,
            "cpus-per-task": self.cpus_per_task,
            "time": self.time,
            "partition": self.partition,
            "account": self.account,
            "signal": f"SIGUSR1@{self.signal_seconds}",
            "requeue": True,
            "open-mode": "append",  # a requeued attempt appends to the same log
            "output": f"{self.run_dir}/slurm-{'%A_%a' if count else '%j'}.out",
            "chdir": self.chdir,
            # each task is a job of its own (its own SLURM_JOB_ID): requeued, and requeueing itself, alone
            "array": f"0-{count - 1}{f'%{self.max_parallel}' if self.max_parallel else ''}" if count else None,
        }
        header = [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in options.items() if v is not None]
        header += [f"#SBATCH {line}" for line in self.sbatch_lines]
        srun = shlex.join([self.python, str(ROOT / "cli.py"), *self.cli_args()])
        srun += ' "${task[@]}"' if count else ""  # the array task's values and run folder (later flags win)
        return "\n".join(
            [
                "#!/bin/bash",
                "# Rendered by `python -m tools.slurm submit`; submit again with `sbatch THIS_FILE`.",
                *header,
                "set -eo pipefail  # no -u: module systems (Lmod) read unset variables",
                *self.setup_lines,
                "export PYTHONUNBUFFERED=1",
                "# Slurm >= 22.05: srun no longer inherits --cpus-per-task from the allocation",
                "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}",
                *(self._array_lines() if count else []),
                "# Every attempt (requeues included) uses the same run dir: SIGUSR1 -> hpc_ckpt_N.ckpt there -> resume",
                'echo "job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $SLURM_JOB_NODELIST"',
                *(self._requeue_on_failure(srun) if self.max_restarts else [f"srun --kill-on-bad-exit=1 {srun}"]),
                "",
            ]
        )

    def _requeue_on_failure(self, srun: str) -> list[str]:
        """``--launch.max_restarts K``: a failed step (a rank that died or that the hang watch found stuck, a killed
        DataLoader worker, a lost node) is a fault, recorded in ``RUN_DIR/faults.jsonl`` (by the app when it could,
        else here), and requeues the job while the job's faults number at most K; the requeued attempt resumes its
        newest checkpoint (:class:`app.checkpoint.Checkpoints`). Requeues by preemption or wall time never count.
        SLURM's own ``scontrol requeue``, decided by this script: with ``--kill-on-bad-exit`` the step's other ranks
        are gone by then, and a requeue made already (a preemption's, by Lightning) is not made twice."""
        # a grid's task records in its own run folder, the last of its options (``--trainer.default_root_dir``)
        where = "${task[-1]}/faults.jsonl" if self.grid else f"{self.run_dir}/faults.jsonl"
        k, faults = self.max_restarts, f'"{where}"' if self.grid else shlex.quote(where)
        mine = '{"job": "%s", "attempt": %d, "kind": "step-failed", "step": null, "node": "%s", "exit": %d}'
        return [
            f"# --launch.max_restarts {k}: a failed step requeues the job (scontrol requeue) while its faults number "
            f"at most {k} (requeues by preemption or wall time do not count);",
            "# the requeued attempt resumes from its newest checkpoint. srun's lines name the node of a failed task.",
            "export DPTRAIN_REQUEUE_BY=script  # this script requeues; app.resilience.requeue leaves it to it",
            "status=0",
            f"srun --kill-on-bad-exit=1 {srun} || status=$?",
            f'restarts=$(scontrol show job {self.job_ref} | grep -o "Restarts=[0-9]*" | cut -d= -f2 || true)',
            'if [ "$status" -ne 0 ] && [ "${restarts:-0}" -le "${SLURM_RESTART_COUNT:-0}" ]; then',
            "  attempt=$((${SLURM_RESTART_COUNT:-0} + 1))  # the app records its fault (kind, step, node) when it can",
            f'  grep -qs "\\"job\\": \\"$SLURM_JOB_ID\\", \\"attempt\\": $attempt," {faults} ||',
            f'    printf \'{mine}\\n\' "$SLURM_JOB_ID" "$attempt" "$SLURM_JOB_NODELIST" "$status" >> {faults}',
            f'  faults=$(grep -c "\\"job\\": \\"$SLURM_JOB_ID\\"," {faults} || true)',
            '  counts="fault $faults of '
            + str(k)
            + "; $((${SLURM_RESTART_COUNT:-0} - faults + 1)) requeues by time or "
            'preemption before it"',
            f'  if [ "$faults" -le {k} ]; then',
            '    echo "SLURM: the job step failed (exit $status): $counts; requeue $attempt: the job resumes from its '
            'newest checkpoint. If srun named a node above, keep the job off it: sbatch --exclude NODE"',
            f"    scontrol requeue {self.job_ref}",
            "    exit 0",
            "  fi",
            f'  echo "error: the job step failed (exit $status) and no requeue is left ($counts: {k} of {k} used), so '
            f"the job fails. Fix: look at the failed rank's lines above (every fault: {where}), "
            'then submit again with --ckpt_path last"',
            "fi",
            'exit "$status"',
        ]


def submit(job: Job, dry_run: bool) -> str | None:
    """Prints the script (dry run) or writes it into the run dir and submits it; returns the job id."""
    script = job.render()
    if dry_run:
        print(script, end="")
        return None
    folder = Path(job.run_dir) / "sbatch"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{job.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sh"
    path.write_text(script)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        missing = f"error: `sbatch` is not on PATH; run this on a SLURM login node. The script is in {path}"
        sys.exit(with_link(missing, "sbatch"))
    if out.returncode != 0:
        sys.exit(f"{with_link(f'error: sbatch refused {path}:', 'sbatch')}\n{out.stderr.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: {path}\n  log: {job.run_dir}/slurm-{job_id}.out   status: squeue -j {job_id}")
    return job_id
