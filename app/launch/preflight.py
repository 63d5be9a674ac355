"""The preflight: every rank builds the same plan from the parsed config and its launcher's variables, checks it and
rank 0 prints it, before any process group is formed.

A mismatch between the launcher and the config stops every rank at once with the fix in the message, instead of a
hang in the rendezvous or an error deep inside the Trainer. Lightning validates some of this too
(``SLURMEnvironment``), but only after the Trainer exists and without the plan around it, so the checks are repeated
here with the fix spelled out.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint import Checkpoints, Resume, local_root, restarts_in_place
from app.launch import choices
from app.launch.checks import config_problems, launch_problems, machine_problems
from app.launch.plan import Plan, device_count
from core.config import get
from core.device import AUTO, auto_precision, on_cuda
from core.env import Launch, detect
from core.errors import UserError, with_link
from core.layout import layout_of, strategy_name

__all__ = ["PreflightError", "build", "machine_problems", "preflight"]


class PreflightError(UserError):
    """The config cannot run as given (launcher, machine, names, numbers); raised on every rank before the Trainer.
    Its first line links to the preflight's section, each problem below it to its own (or to the preflight's)."""

    help = "preflight"


def build(
    config: Any,
    launch: Launch | None = None,
    timeout: float | None = None,
    hang_timeout: float | None = None,
    resume: Resume | None = None,
    max_restarts: int = 0,
    startup_timeout: float | None = None,
) -> Plan:
    """The plan for a parsed subcommand config (LightningCLI's ``config[subcommand]``); ``resume``: what the run
    resumes from (the CLI's :meth:`app.checkpoint.Checkpoints.prepare`; decided here for a fit when not given);
    ``max_restarts``: ``--launch.max_restarts`` of a ``fit``."""
    launch = launch or detect()
    trainer = config.trainer
    accelerator = str(trainer.get("accelerator") or "auto")
    checkpoints = Checkpoints.of(config)
    root = str(checkpoints.root.resolve())
    resume = resume or checkpoints.decide(config.get("ckpt_path"), "fit", launch)
    strategy = trainer.get("strategy") or "auto"
    devices, nodes = device_count(trainer.get("devices", "auto"), accelerator), int(trainer.get("num_nodes") or 1)
    if launch.node_range and launch.nodes:  # elastic torchrun: this round's nodes (WORLD_SIZE), whatever the config
        nodes = launch.nodes
    plan = Plan(
        launch=launch,
        strategy=strategy_name(strategy),
        accelerator=accelerator,
        devices=devices,
        num_nodes=nodes,
        batch_size=get(config, "data", "batch_size"),
        global_batch_size=get(config, "data", "global_batch_size"),
        lr=get(config, "model", "optimizer", "lr"),
        lr_reference_batch_size=get(config, "model", "lr_reference_batch_size"),
        precision=str(trainer.get("precision") or "32-true").replace(AUTO, auto_precision(on_cuda(accelerator))),
        root_dir=root,
        resume=resume,
        timeout=timeout,
        hang_timeout=hang_timeout,
        startup_timeout=startup_timeout,
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        layout=layout_of(strategy, devices, nodes),
        sync_batchnorm=bool(trainer.get("sync_batchnorm")),
        checkpoint_minutes=get(config, "checkpoint", "interval_minutes")
        if trainer.get("enable_checkpointing") is not False and get(config, "checkpoint", "save_last")
        else None,
        max_restarts=max_restarts,
    )
    watched = (plan.launched_world_size or 1) > 1  # the hang watch, and its start-up allowance, watch several ranks
    plan.choices = choices.lines(config, accelerator, root, startup_timeout if watched else None, plan.strategy)
    plan.choices += choices.recipe_lines(config, plan.batch()[1])
    if plan.checkpoint_minutes:
        _saves(plan, config, launch)
    if max_restarts:
        _restart_notes(plan, max_restarts, launch)
    plan.problems += launch_problems(plan) + config_problems(config)
    return plan


def _saves(plan: Plan, config: Any, launch: Launch) -> None:
    """How the periodic saves are written: in the background, and copied to the node's own storage."""
    plan.checkpoint_background = get(config, "checkpoint", "background") is not False
    local = get(config, "checkpoint", "local_copy")
    in_place = plan.by_agent or restarts_in_place(launch)
    where = local_root(launch) if (in_place if local is None else local) else None
    plan.local_copy = str(where) if where is not None else None


def _restart_notes(plan: Plan, max_restarts: int, launch: Launch) -> None:
    """What ``--launch.max_restarts`` does under this launcher, or why it is ignored."""
    if not plan.by_agent and (why := ignored_restarts(plan)):
        plan.notes.append(f"--launch.max_restarts {max_restarts} ignored: {why}.")
    if launch.launcher == "slurm":
        by = "the batch script" if launch.requeue_by_script else "the app (scontrol requeue)"
        plan.notes.append(
            f"--launch.max_restarts {max_restarts}: a fault requeues the job, done by {by}, while the job's faults "
            f"number at most {max_restarts} (each recorded in the run dir's faults.jsonl; requeues by preemption or "
            "wall time do not count); the requeued job resumes from its "
            "newest checkpoint. Your sbatch script needs --requeue (and --open-mode=append to keep each attempt's log)."
        )


def ignored_restarts(plan: Plan) -> str | None:
    """Why ``--launch.max_restarts`` does not apply to this run, and what restarts it instead; None when it applies
    (a worker of the agent it started: torchrun's variables, with its ``TORCHELASTIC_MAX_RESTARTS``)."""
    launch, given = plan.launch, plan.max_restarts
    if launch.launcher == "torchrun":
        same = launch.max_restarts == given
        return None if same else f"torchrun started this job: its --max-restarts ({launch.max_restarts}) applies"
    if launch.launcher == "slurm":
        return None  # the batch script of `python -m tools.slurm submit` requeues a failed step (the plan says so)
    return "several nodes: start them with torchrun --max-restarts" if plan.num_nodes > 1 else "one process"


def preflight(
    config: Any,
    timeout: float | None = None,
    echo: bool = True,
    hang_timeout: float | None = None,
    resume: Resume | None = None,
    max_restarts: int = 0,
    startup_timeout: float | None = None,
    launch: Launch | None = None,
) -> Plan:
    """Builds and checks the plan; rank 0 prints it. Every rank exits with the fix when the plan has problems."""
    plan = build(
        config, launch=launch, timeout=timeout, hang_timeout=hang_timeout, resume=resume, max_restarts=max_restarts,
        startup_timeout=startup_timeout,
    )  # fmt: skip
    if plan.num_nodes != int(config.trainer.get("num_nodes") or 1):  # elastic torchrun: the Trainer's too
        plan.notes.append(
            f"trainer.num_nodes={config.trainer.get('num_nodes')} replaced by the {plan.num_nodes} node(s) torchrun "
            f"started this round (--nnodes {plan.launch.node_range[0]}:{plan.launch.node_range[1]})."
        )
        config.trainer.num_nodes = plan.num_nodes

    plan.problems += machine_problems(plan, config)
    if echo:
        rank_zero_info(plan.render())
    if plan.problems:
        # each problem links to its own section where it has one (given by its check), else to the preflight's
        lines = [with_link(f"  - {problem}", "preflight") for problem in plan.problems]
        head = "preflight: this run cannot start as configured; nothing was started."
        raise PreflightError("\n".join([head, *lines]))
    return plan
