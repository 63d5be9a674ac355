"""The preflight plan: what this run will do across processes, checked before any process group is formed.

Every rank builds the same plan from the parsed config and its launcher's variables; rank 0 prints it. A mismatch
between the launcher and the config stops every rank at once with the fix in the message, instead of a hang in the
rendezvous or an error deep inside the Trainer. Lightning validates some of this too (``SLURMEnvironment``), but only
after the Trainer exists and without the plan around it, so the checks are repeated here with the fix spelled out.

The numbers come from the strategy's :class:`~app.strategies.layout.Layout`; the checks are in
:mod:`app.launch.checks`, the rendezvous timeout's explanation in :mod:`app.launch.rendezvous`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.config import get
from app.launch.checks import LAUNCH_CHECKS, LAUNCH_NOTES, LAUNCHER_NAMES, config_problems, machine_problems
from app.launch.env import Launch, detect
from app.strategies.layout import Layout, layout_of, strategy_name

__all__ = ["Plan", "PreflightError", "build", "device_count", "machine_problems", "preflight"]


class PreflightError(SystemExit):
    """The config cannot run as given (launcher, machine, names, numbers); raised on every rank before the Trainer."""


def device_count(devices: Any, accelerator: str | None) -> int | None:
    """How many devices ``trainer.devices`` asks for on each node; None if unknown."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text in ("auto", "-1"):
        import torch

        cuda = torch.cuda.device_count()
        if accelerator in (None, "auto", "gpu", "cuda") and cuda:
            return cuda
        return 1 if accelerator in (None, "auto", "cpu") or not cuda else None
    return None


@dataclass
class Plan:
    """What the run will do; ``problems`` are fatal, ``notes`` are printed with the plan."""

    launch: Launch
    strategy: str
    accelerator: str
    devices: int | None
    num_nodes: int
    batch_size: int | None
    global_batch_size: int | None
    lr: float | None
    precision: str
    root_dir: str
    resume: str | None
    timeout: float | None
    accumulate: int = 1
    lr_reference_batch_size: int | None = None
    layout: Layout | None = None  # default: the registered strategy's layout on ``devices``
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = layout_of(self.strategy, self.devices, self.num_nodes)

    @property
    def devices_per_process(self) -> int:
        """GPUs each process drives of its own (``ddp_mp``: its stages); 1 when a process has one device."""
        return self.layout.devices_per_process if self.layout.needs_process_gpus else 1

    @property
    def world_size(self) -> int | None:
        """Processes the config expects (the layout's processes per node x nodes; ``dp``: one process)."""
        if self.layout.one_process:
            return 1
        return None if self.layout.processes_per_node is None else self.layout.processes_per_node * self.num_nodes

    @property
    def launched_world_size(self) -> int | None:
        """The launcher's world size, or the config's when Lightning starts the processes itself."""
        return self.launch.world_size if self.launch.launcher != "none" else self.world_size

    def check(self) -> Plan:
        """Fills ``problems`` with every disagreement between launcher and config, each with its fix."""
        self.problems += [problem for check in LAUNCH_CHECKS if (problem := check(self))]
        self.notes += [note for check in LAUNCH_NOTES if (note := check(self))]
        return self

    def batch(self) -> tuple[int | None, int | None]:
        """Images per device (``dp``: per process) and per optimizer step over every process."""
        from datamodules.base import BatchPlan

        world = self.launched_world_size
        if self.global_batch_size is not None and world:
            return self.global_batch_size // (world * self.accumulate), self.global_batch_size
        if self.batch_size is None or world is None:
            return self.batch_size, None
        processes = 1 if self.layout.splits_batch else world
        return self.batch_size, BatchPlan(self.batch_size, processes, self.accumulate).global_batch

    def _describe_lr(self, global_batch: int | None) -> str:
        reference = self.lr_reference_batch_size
        if not reference or self.lr is None:
            return f"{self.lr} (as configured; model.lr_reference_batch_size unset, so not scaled by the batch)"
        if global_batch is None:
            return f"{self.lr} per {reference} images of global batch (linear scaling; global batch known at start)"
        from modules.classifier import linear_scaled_lr

        scaled = linear_scaled_lr(self.lr, global_batch, reference)
        return f"{scaled:g} = {self.lr:g} per {reference} images x global batch {global_batch} (linear scaling)"

    def _device_kind(self) -> str:
        dev = "cuda" if self.accelerator in ("gpu", "cuda") else self.accelerator
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return dev

    def _node_lines(self, nodes: int, per_node: int | None) -> list[str]:
        """One line per node (8 at most): its host, its ranks and their devices."""
        launch, dev, k = self.launch, self._device_kind(), self.devices_per_process
        hosts = list(launch.hosts) if launch.launcher == "slurm" else []
        lines = []
        for node in range(min(nodes, 8)):
            host = hosts[node] if node < len(hosts) else ("this host" if node == launch.node_rank else "?")
            if not per_node:
                continue
            first = node * per_node
            ranks = f"ranks {first}-{first + per_node - 1}" if per_node > 1 else f"rank {first}"
            gpus = per_node * (k if dev == "cuda" else 1)
            devices = f"{dev}:0-{gpus - 1}" if gpus > 1 else f"{dev}:0"
            if dev == "cuda" and k > 1:
                devices += f" ({k} per process)"
            if self.layout.splits_batch:
                ranks, devices = "rank 0 (one process)", f"{dev}:0-{(self.devices or 1) - 1} via DataParallel"
            lines.append(f"  node {node} {host}: {ranks} -> {devices}")
        if nodes > 8:
            lines.append(f"  ... {nodes - 8} more node(s)")
        return lines

    def render(self) -> str:
        """The plan as printed by rank 0."""
        launch = self.launch
        nodes = launch.nodes or self.num_nodes
        per_node = launch.tasks_per_node or self.devices
        lines = [
            f"launcher     {LAUNCHER_NAMES[launch.launcher]}"
            + (f", job {launch.job_id} (restart {launch.restart_count})" if launch.job_id else ""),
            f"layout       {nodes} node(s) x {per_node} process(es) = world size {self.launched_world_size}; "
            f"strategy {self.strategy}, accelerator {self.accelerator}, precision {self.precision}",
            *self._node_lines(nodes, per_node),
        ]
        per_device, total = self.batch()
        lines += [
            f"batch        {per_device} per {'process' if self.layout.splits_batch else 'device'}, global {total}",
            f"lr           {self._describe_lr(total)}",
            f"run dir      {self.root_dir}",
            f"resume from  {self.resume or 'nothing (fresh start)'}",
        ]
        if self.timeout is not None:
            lines.append(f"timeout      ranks wait {self.timeout:g} s for each other (--launch.timeout)")
        lines += [f"note: {note}" for note in self.notes]
        return "preflight plan\n" + "\n".join(f"  {line}" for line in lines)


def build(config: Any, launch: Launch | None = None, timeout: float | None = None) -> Plan:
    """The plan for a parsed subcommand config (LightningCLI's ``config[subcommand]``)."""
    from app.checkpoint import hpc_checkpoint

    launch = launch or detect()
    trainer = config.trainer
    accelerator = str(trainer.get("accelerator") or "auto")
    root = str(Path(trainer.get("default_root_dir") or ".").resolve())
    resume = config.get("ckpt_path")
    if resume is None and launch.launcher == "slurm" and (hpc := hpc_checkpoint(root)) is not None:
        resume = f"hpc: {hpc} (Lightning resumes from it automatically under SLURM)"
    strategy = trainer.get("strategy") or "auto"
    devices, nodes = device_count(trainer.get("devices", "auto"), accelerator), int(trainer.get("num_nodes") or 1)
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
        precision=str(trainer.get("precision") or "32-true"),
        root_dir=root,
        resume=str(resume) if resume else None,
        timeout=timeout,
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        layout=layout_of(strategy, devices, nodes),
    ).check()
    plan.problems += config_problems(config)
    return plan


def preflight(config: Any, timeout: float | None = None, echo: bool = True) -> Plan:
    """Builds and checks the plan; rank 0 prints it. Every rank exits with the fix when the plan has problems."""
    plan = build(config, timeout=timeout)
    from lightning.pytorch.utilities import rank_zero_info

    plan.problems += machine_problems(plan, config)
    if echo:
        rank_zero_info(plan.render())
    if plan.problems:
        raise PreflightError(
            "error: preflight: this run cannot start as configured; nothing was started.\n"
            + "\n".join(f"  - {problem}" for problem in plan.problems)
        )
    return plan
