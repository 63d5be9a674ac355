"""The preflight plan: what this run will do across processes (launcher, layout, ranks and devices, batch, lr,
resume), as rank 0 prints it.

The numbers come from the strategy's :class:`~core.layout.Layout`. :mod:`app.launch.preflight` builds the
plan from the parsed config, :mod:`app.launch.checks` checks it, :mod:`app.launch.rendezvous` explains a rendezvous
timeout with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import app.strategies  # noqa: F401  (registers the app's modes: the plan looks a mode up by its name)
from app.checkpoint import From, Resume
from core.batch import linear_scaled_lr, resolve_batch
from core.env import LAUNCHER_NAMES, Launch
from core.layout import Layout, layout_of


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
    resume: Resume | None  # what the run resumes from (None: not decided, a fresh start)
    timeout: float | None
    hang_timeout: float | None = None  # the hang watch's (``app.callbacks.hang_watch``); 0: off
    startup_timeout: float | None = None  # its allowance while the job starts (set-up, sanity check, first step)
    accumulate: int = 1
    lr_reference_batch_size: int | None = None
    layout: Layout | None = None  # default: the registered strategy's layout on ``devices``
    sync_batchnorm: bool = False
    checkpoint_minutes: float | None = None  # last.ckpt every that many minutes of training (None: checkpoints off)
    checkpoint_background: bool = True  # saves during training written by a thread (--checkpoint.background)
    local_copy: str | None = None  # the node-local folder of last.ckpt's copy (--checkpoint.local_copy), or None
    max_restarts: int = 0  # --launch.max_restarts (fit only); torch's elastic agent starts the ranks: ``by_agent``
    choices: list[str] = field(default_factory=list)  # how it computes (app.launch.choices), printed after the lr
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = layout_of(self.strategy, self.devices, self.num_nodes)

    @property
    def by_agent(self) -> bool:
        """This process hands the job to torch's elastic agent (:mod:`app.launch.elastic`): ``--launch.max_restarts``
        on a one-node multi-process run that Lightning's launcher would start."""
        world = self.world_size or 1
        return self.max_restarts > 0 and self.launch.launcher == "none" and self.num_nodes == 1 and world > 1

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

    def batch(self) -> tuple[int | None, int | None]:
        """Images per device (``dp``: per process) and per optimizer step over every process."""
        world = self.launched_world_size
        if world is None or (self.batch_size is None and self.global_batch_size is None):
            return self.batch_size, None
        processes = 1 if self.layout.splits_batch else world
        try:
            batch = resolve_batch(self.batch_size or 0, self.global_batch_size, processes, self.accumulate)
        except ValueError:  # a global batch that does not split: the preflight's problem, which names the fix
            return None, self.global_batch_size
        return batch.per_device, batch.global_batch

    def _describe_lr(self, global_batch: int | None) -> str:
        reference = self.lr_reference_batch_size
        if not reference or self.lr is None:
            return f"{self.lr} (as configured; model.lr_reference_batch_size unset, so not scaled by the batch)"
        if global_batch is None:
            return f"{self.lr} per {reference} images of global batch (linear scaling; global batch known at start)"
        scaled = linear_scaled_lr(self.lr, global_batch, reference)
        return f"{scaled:g} = {self.lr:g} per {reference} images x global batch {global_batch} (linear scaling)"

    def _describe_resume(self) -> str:
        resume = self.resume
        if resume is None or (resume.path is None and resume.source is From.NOTHING):
            return "nothing (fresh start)"
        return resume.describe()

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

    def _elastic(self) -> str:
        """torchrun's elastic settings: restarts (``TORCHELASTIC_*``) and the node range, and what a restart does."""
        launch, parts = self.launch, []
        if launch.max_restarts:
            parts.append(
                f"restart {launch.restart_count} of at most {launch.max_restarts}: when a worker dies, torchrun "
                "restarts the group, which resumes from the newest last.ckpt of this run"
            )
        if launch.node_range:
            low, high = launch.node_range
            parts.append(f"--nnodes {low}:{high}, {launch.nodes} node(s) this round (world size from WORLD_SIZE)")
        return "elastic      " + "; ".join(parts)

    def render(self) -> str:
        """The plan as printed by rank 0."""
        launch = self.launch
        nodes = launch.nodes or self.num_nodes
        per_node = launch.tasks_per_node or self.devices
        agent = (
            f"torch's elastic agent, started by this process (--launch.max_restarts {self.max_restarts}): a rank that "
            "dies or hangs restarts the group, which resumes from the newest last.ckpt of this run"
        )
        lines = [
            f"launcher     {agent if self.by_agent else LAUNCHER_NAMES[launch.launcher]}"
            + (" (started by python -m torch.distributed.launch, deprecated)" if launch.legacy_launch else "")
            + (f", job {launch.job_id} (restart {launch.restart_count})" if launch.job_id else ""),
            *([self._elastic()] if launch.max_restarts or launch.node_range else []),
            f"layout       {nodes} node(s) x {per_node} process(es) = world size {self.launched_world_size}; "
            f"strategy {self.strategy}, accelerator {self.accelerator}, precision {self.precision}",
            *self._node_lines(nodes, per_node),
        ]
        per_device, total = self.batch()
        lines += [
            f"batch        {per_device} per {'process' if self.layout.splits_batch else 'device'}, global {total}",
            f"lr           {self._describe_lr(total)}",
            *self.choices,
            f"run dir      {self.root_dir}",
            f"resume from  {self._describe_resume()}",
        ]
        if self.checkpoint_minutes:
            how = "written in the background, " if self.checkpoint_background else ""
            lines.append(
                f"checkpoint   last.ckpt every {self.checkpoint_minutes:g} min of training, {how}and the one before "
                "kept (--checkpoint.interval_minutes; a fault loses at most that much)"
            )
            if self.local_copy:
                lines.append(
                    f"             and a copy in {self.local_copy}, read first by a restart on this node "
                    "(--checkpoint.local_copy)"
                )
        if self.timeout is not None:
            lines.append(f"timeout      ranks wait {self.timeout:g} s for each other (--launch.timeout)")
        if self.hang_timeout is not None and (self.launched_world_size or 1) > 1:
            watch = (
                f"a rank without a finished step for {self.hang_timeout:g} s is named with where it is, and the job "
                "ends (--launch.hang_timeout; 0: off)"
                if self.hang_timeout
                else "off (--launch.hang_timeout 0)"
            )
            lines.append(f"hang watch   {watch}")
            if self.hang_timeout and self.startup_timeout:
                lines.append(
                    f"             while the job starts (set-up, sanity check, first step): {self.startup_timeout:g} s "
                    "(--launch.startup_timeout)"
                )
        lines += [f"note: {note}" for note in self.notes]
        return "preflight plan\n" + "\n".join(f"  {line}" for line in lines)
