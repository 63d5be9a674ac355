"""Render and submit an sbatch script from the same command line ``cli.py`` takes.

    python -m tools.slurm submit --nodes 2 --gpus-per-node 4 --time 24:00:00 --partition gpu \\
        [--account A] [--sbatch mem=200G] [--setup "module load cuda"] [--dry-run] -- fit --config configs/x.yaml
    python -m tools.slurm submit --grid model.optimizer.lr=0.1,0.01 --grid data.batch_size=64,128 --max-parallel 2 ...
    python -m tools.slurm results runs/NAME

The command after ``--`` is parsed by the app's own CLI (nothing is
instantiated) with ``--trainer.num_nodes``, ``--trainer.devices`` and ``--trainer.accelerator`` appended, and checked
by the preflight plan as SLURM will launch it, so a mistake is reported here instead of after the job waited in the
queue. The script itself is :class:`tools.sbatch.Job`'s; a grid is one job array (:mod:`tools.grid`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.checkpoint import Checkpoints
from app.command import CLI
from app.command import main as cli_main
from app.launch.preflight import build
from core.env import Launch
from core.errors import with_link
from tools import grid
from tools.sbatch import Job, submit


def resolve_config(cli_args: list[str]):
    """The subcommand's config exactly as ``cli.py`` would resolve it, without instantiating anything."""

    class ParseOnlyCLI(CLI):
        # LightningCLI parses in its constructor and then instantiates and runs; only the parse is wanted here
        def _parse_ckpt_path(self) -> None:
            # a given file is checked and its hyperparameters applied, as the job will; what the job resumes from
            # (last, hpc, a requeue) is decided by the job on its node, never at submit time (nothing moved aside)
            subcommand = self.config.get("subcommand")
            resume = Checkpoints.prepare(self._subcommand_config(), subcommand, None)
            if resume.hparams:
                self.config = self.parser.parse_object({subcommand: {"model": resume.hparams}}, self.config)

        def instantiate_classes(self) -> None:
            pass

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when sys.argv holds other arguments than ``args``
    try:
        cli = cli_main(cli_args, cli_class=ParseOnlyCLI)
    finally:
        sys.argv = argv
    return cli.config[cli.subcommand]


def build_job(ns: argparse.Namespace, command: list[str]) -> Job:
    """Turns the submit options and the user's command into a checked :class:`Job`; exits with the fix on a problem."""
    if not command or command[0] not in ("fit", "validate", "test", "predict"):
        sys.exit(
            with_link(
                "error: give the cli.py command after `--`, starting with its subcommand, e.g. "
                "`python -m tools.slurm submit --nodes 1 --gpus-per-node 4 -- fit --config configs/mnist.yaml`",
                "slurm-submit",
            )
        )
    tasks = ns.tasks_per_node or ns.gpus_per_node
    if not tasks:
        sys.exit(
            with_link(
                "error: say how many processes per node: --gpus-per-node G (one per GPU) or, on CPUs, "
                "--tasks-per-node T",
                "slurm-submit",
            )
        )
    if ns.gpus_per_node and ns.gpus_per_node % tasks:
        uneven = f"error: --gpus-per-node {ns.gpus_per_node} is not a multiple of --tasks-per-node {tasks}"
        sys.exit(with_link(uneven, "slurm-submit"))
    job = Job(command=list(command), nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, tasks_per_node=tasks)
    job.grid, job.max_parallel = grid.parse(ns.grid), ns.max_parallel
    if ns.max_parallel < 0 or (ns.max_parallel and not job.grid):
        grid.stop("--max-parallel P (P >= 1) limits how many tasks of a --grid run at once: give it with a --grid")
    if job.grid:
        grid.check_size(job)
    # a grid's keys are checked by parsing the command with the first task's values, as its task will
    config = resolve_config([*job.cli_args(with_run_dir=False), *grid.first_values(job)])
    job.run_dir = str(Path(config.trainer.get("default_root_dir") or ".").resolve())
    job.chdir = str(Path.cwd())
    workers = config.data.get("init_args", config.data).get("num_workers") or 0
    if workers == "auto" and not ns.cpus_per_task:
        sys.exit(
            with_link(
                "error: data.num_workers auto takes the CPUs SLURM gives each task, so say how many: "
                "--cpus-per-task C (C - 1 loader workers per process), or give --data.num_workers N.",
                "slurm-submit",
            )
        )
    job.cpus_per_task = ns.cpus_per_task or workers + 1  # the DataLoader workers plus the training process
    job.job_name = ns.job_name or f"dptrain-{Path(job.run_dir).name}"
    job.time, job.partition, job.account = ns.time, ns.partition, ns.account
    job.signal_seconds, job.python = ns.signal_seconds, ns.python
    job.max_restarts = int(config.launch.get("max_restarts") or 0)
    job.sbatch_lines = [line if line.startswith("--") else f"--{line}" for line in ns.sbatch]
    job.setup_lines = list(ns.setup)
    world = job.nodes * job.tasks_per_node
    launch = Launch("slurm", nodes=job.nodes, tasks_per_node=tasks, world_size=world, in_batch_step=False)
    plan = build(config, launch=launch)
    if plan.problems:
        # the first line links here, each problem to its own section (as the preflight's own list)
        head = with_link("error: this job would stop at its preflight check; nothing was submitted.", "slurm-submit")
        sys.exit("\n".join([head, *(with_link(f"  - {p}", "preflight") for p in plan.problems)]))
    return job


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.slurm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("submit", help="render an sbatch script for a cli.py command and submit it")
    s.add_argument("--nodes", type=int, default=1, help="nodes (= trainer.num_nodes)")
    s.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node; one process each unless --tasks-per-node"
    )
    s.add_argument("--tasks-per-node", type=int, default=0, help="processes per node (= trainer.devices); CPU jobs")
    s.add_argument("--cpus-per-task", type=int, default=0, help="default: data.num_workers + 1")
    s.add_argument("--time", help="wall time limit, e.g. 24:00:00 (SIGUSR1 arrives --signal-seconds before it)")
    s.add_argument("--partition")
    s.add_argument("--account")
    s.add_argument("--job-name")
    s.add_argument("--signal-seconds", type=int, default=90, help="checkpoint-and-requeue this long before the limit")
    s.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra #SBATCH option, repeatable: --sbatch mem=200G",
    )
    s.add_argument(
        "--setup", action="append", default=[], metavar="LINE", help="shell line run before srun, repeatable"
    )
    s.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    s.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="one job array task per combination of values, each in its own run folder, repeatable",
    )
    s.add_argument("--max-parallel", type=int, default=0, metavar="P", help="run at most P array tasks at a time")
    s.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    r = sub.add_parser("results", help="the table of a --grid job's runs, also written to results.csv")
    r.add_argument("root", metavar="RUN_ROOT", help="the grid's --trainer.default_root_dir, or NAME for runs/NAME")
    return p


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ns = parser().parse_args(ours)
    if ns.action == "results":
        grid.results(ns.root)
        return None
    job = build_job(ns, command)
    job_id = submit(job, ns.dry_run)
    if job.grid and job_id:
        grid.write_manifest(job, job_id)
    return job_id


if __name__ == "__main__":
    main()
