"""The preflight plan: what this run will do across processes, checked before any process group is formed.

Every rank builds the same plan from the parsed config and its launcher's variables; rank 0 prints it. A mismatch
between the launcher and the config stops every rank at once with the fix in the message, instead of a hang in the
rendezvous or an error deep inside the Trainer. Lightning validates some of this too (``SLURMEnvironment``), but only
after the Trainer exists and without the plan around it, so the checks are repeated here with the fix spelled out.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from app.launch.env import Launch, detect, main_address, resolves

LAUNCHER_NAMES = {"none": "none (Lightning starts the local processes)", "torchrun": "torchrun", "slurm": "SLURM"}
FLAG = {"slurm": "--ntasks-per-node", "torchrun": "--nproc_per_node"}
NODES_FLAG = {"slurm": "--nodes", "torchrun": "--nnodes"}


class PreflightError(SystemExit):
    """The config cannot run as given (launcher, machine, names, numbers); raised on every rank before the Trainer."""


def _get(node: Any, *keys: str, default: Any = None) -> Any:
    """``node.a.b`` through Namespaces/dicts, trying ``init_args`` on the way; ``default`` when any is missing."""
    for key in keys:
        if node is None:
            return default
        value = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        if value is None and hasattr(node, "get") and node.get("init_args") is not None:
            value = node["init_args"].get(key)
        node = value
    return default if node is None else node


def device_count(devices: Any, accelerator: str | None) -> int | None:
    """How many devices (= processes, one per device) ``trainer.devices`` asks for on each node; None if unknown."""
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


def strategy_name(strategy: Any) -> str:
    """The registered name of ``trainer.strategy`` (``dp``, ``ddp``, ...), or its class path."""
    if isinstance(strategy, str):
        return strategy
    class_path = _get(strategy, "class_path") or type(strategy).__name__
    from lightning.pytorch.strategies import StrategyRegistry

    module, _, qualname = str(class_path).rpartition(".")
    for name, entry in StrategyRegistry.items():
        cls = entry["strategy"]
        # the config may name the class where its package exports it: app.strategies.DDPModelParallelStrategy
        if cls.__qualname__ == qualname and cls.__module__.startswith(module) and not entry["init_params"]:
            return name
    return class_path


def devices_per_process(strategy: Any) -> int:
    """GPUs each process drives (``ddp_mp``: its stages): the config's value, else the registered strategy's default."""
    given = _get(strategy, "devices_per_process")
    if given is not None:
        return int(given)
    import inspect

    from lightning.pytorch.strategies import StrategyRegistry

    name = strategy_name(strategy)
    if name not in StrategyRegistry:
        return 1
    entry = StrategyRegistry[name]  # read, not instantiated: some strategies need packages that may be missing
    default = inspect.signature(entry["strategy"]).parameters.get("devices_per_process")
    return int(entry["init_params"].get("devices_per_process", default.default if default is not None else 1))


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
    devices_per_process: int = 1  # ddp_mp: the GPUs each process splits its model over
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def _describe_lr(self, global_batch: int | None) -> str:
        reference = self.lr_reference_batch_size
        if not reference or self.lr is None:
            return f"{self.lr} (as configured; model.lr_reference_batch_size unset, so not scaled by the batch)"
        if global_batch is None:
            return f"{self.lr} per {reference} images of global batch (linear scaling; global batch known at start)"
        from modules.classifier import linear_scaled_lr

        scaled = linear_scaled_lr(self.lr, global_batch, reference)
        return f"{scaled:g} = {self.lr:g} per {reference} images x global batch {global_batch} (linear scaling)"

    @property
    def is_dp(self) -> bool:
        return self.strategy == "dp"

    @property
    def world_size(self) -> int | None:
        """Processes the config expects: one per device and node (``dp``: one process drives all devices)."""
        if self.is_dp:
            return 1
        return None if self.devices is None else self.devices * self.num_nodes

    def check(self) -> Plan:
        """Fills ``problems`` with every disagreement between launcher and config, each with its fix."""
        launch, kind = self.launch, self.launch.launcher
        if kind == "slurm" and launch.ntasks_without_per_node:
            self.problems.append(
                f"SLURM started {launch.world_size} tasks with --ntasks but without --ntasks-per-node, so the tasks of "
                "each node cannot be told apart. Fix: submit with `#SBATCH --nodes=N` and "
                "`#SBATCH --ntasks-per-node=T` (T = trainer.devices), e.g. "
                "`python -m app.launch.slurm submit --nodes N --gpus-per-node T -- fit ...`."
            )
        if kind == "slurm" and launch.in_batch_step and launch.multi_task:
            self.problems.append(
                f"this process is the SLURM batch script itself: the job has {launch.world_size} tasks but only this "
                f"one was started, and it would wait for the other {launch.world_size - 1} forever. "
                "Fix: start the training with `srun python cli.py ...` inside the batch script."
            )
        if self.is_dp and (launch.multi_task or self.num_nodes > 1):
            started = f"{kind} started {launch.world_size} processes" if launch.multi_task else ""
            nodes = f"trainer.num_nodes={self.num_nodes}" if self.num_nodes > 1 else ""
            self.problems.append(
                f"strategy dp drives every device of ONE node from ONE process, but {started or nodes}. "
                "Fix: launch a single process (`python cli.py fit --trainer.strategy dp`, `srun --ntasks-per-node=1 "
                "--nodes=1`, `torchrun --nproc_per_node=1`), or use `--trainer.strategy ddp` (or allreduce) for one "
                "process per device."
            )
        if kind in FLAG and not self.is_dp:
            per_node = launch.tasks_per_node
            if per_node is not None and self.devices is not None and per_node != self.devices:
                self.problems.append(
                    f"{LAUNCHER_NAMES[kind]} starts {per_node} tasks per node ({FLAG[kind]} {per_node}) but "
                    f"trainer.devices={self.devices}; each task drives exactly one device. "
                    f"Fix: `--trainer.devices {per_node}`, or launch with {FLAG[kind]} {self.devices}."
                )
            if launch.nodes is not None and launch.nodes != self.num_nodes:
                self.problems.append(
                    f"{LAUNCHER_NAMES[kind]} runs on {launch.nodes} node(s) ({NODES_FLAG[kind]} {launch.nodes}) but "
                    f"trainer.num_nodes={self.num_nodes}. Fix: `--trainer.num_nodes {launch.nodes}`, or launch with "
                    f"{NODES_FLAG[kind]} {self.num_nodes}."
                )
        if kind == "none" and self.num_nodes > 1 and "MASTER_ADDR" not in launch.env:
            self.problems.append(
                f"trainer.num_nodes={self.num_nodes} but no launcher was detected and MASTER_ADDR is not set, so the "
                "nodes cannot find each other. Fix: launch with `srun` (see `python -m app.launch.slurm submit`) or "
                f"`torchrun --nnodes {self.num_nodes} --node_rank R --master_addr HOST ...`, or export MASTER_ADDR, "
                "MASTER_PORT and NODE_RANK on every node."
            )
        world = launch.world_size if launch.launcher != "none" else self.world_size
        factor = (world or 1) * self.accumulate
        if self.global_batch_size is not None and world and self.global_batch_size % factor:
            lower, upper = (
                max(factor, self.global_batch_size // factor * factor),
                (self.global_batch_size // factor + 1) * factor,
            )
            self.problems.append(
                f"data.global_batch_size={self.global_batch_size} does not split evenly over world size {world} "
                f"({self.num_nodes} node(s) x {self.devices} device(s)) x trainer.accumulate_grad_batches "
                f"{self.accumulate} = {factor}. Fix: a multiple of {factor} (e.g. {lower} or {upper}), or another "
                "device count."
            )
        address = main_address(launch)
        if kind == "slurm" and launch.multi_task and address and not resolves(address):
            source = "MASTER_ADDR" if "MASTER_ADDR" in launch.env else "the first node of SLURM_JOB_NODELIST"
            here = launch.env.get("SLURMD_NODENAME", "this node")
            self.problems.append(
                f"the rendezvous host {address!r} ({source}) does not resolve on {here}; "
                "c10d would retry it forever. Fix: export MASTER_ADDR=<an address of the first node that every node "
                "can reach> in the batch script."
            )
        if kind == "slurm" and launch.restart_count == 0 and self.resume and self.resume.startswith("hpc"):
            self.notes.append(
                "a fresh SLURM job resumes from an HPC checkpoint an earlier preempted job left in "
                f"{self.root_dir}; delete it, or use another --trainer.default_root_dir, to start from scratch."
            )
        if self.is_dp and (self.devices or 1) > 1:
            self.notes.append(
                f"dp: data.batch_size={self.batch_size} is per process and split across the {self.devices} devices."
            )
        return self

    def render(self) -> str:
        """The plan as printed by rank 0."""
        launch = self.launch
        world = launch.world_size if launch.launcher != "none" else self.world_size
        nodes = launch.nodes or self.num_nodes
        per_node = launch.tasks_per_node or self.devices
        lines = [
            f"launcher     {LAUNCHER_NAMES[launch.launcher]}"
            + (f", job {launch.job_id} (restart {launch.restart_count})" if launch.job_id else ""),
            f"layout       {nodes} node(s) x {per_node} process(es) = world size {world}; "
            f"strategy {self.strategy}, accelerator {self.accelerator}, precision {self.precision}",
        ]
        hosts = list(launch.hosts) if launch.launcher == "slurm" else []
        dev = "cuda" if self.accelerator in ("gpu", "cuda") else self.accelerator
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        for node in range(min(nodes, 8)):
            host = hosts[node] if node < len(hosts) else ("this host" if node == launch.node_rank else "?")
            if per_node:
                first = node * per_node
                ranks = f"ranks {first}-{first + per_node - 1}" if per_node > 1 else f"rank {first}"
                gpus = per_node * (self.devices_per_process if dev == "cuda" else 1)
                devices = f"{dev}:0-{gpus - 1}" if gpus > 1 else f"{dev}:0"
                if dev == "cuda" and self.devices_per_process > 1:
                    devices += f" ({self.devices_per_process} per process)"
                if self.is_dp:
                    ranks, devices = "rank 0 (one process)", f"{dev}:0-{(self.devices or 1) - 1} via DataParallel"
                lines.append(f"  node {node} {host}: {ranks} -> {devices}")
        if nodes > 8:
            lines.append(f"  ... {nodes - 8} more node(s)")
        if self.global_batch_size is not None and world:
            per_device, total = self.global_batch_size // (world * self.accumulate), self.global_batch_size
        else:
            per_device = self.batch_size
            total = None if per_device is None or world is None else per_device * (1 if self.is_dp else world)
            total = None if total is None else total * self.accumulate
        lines += [
            f"batch        {per_device} per {'process' if self.is_dp else 'device'}, global {total}",
            f"lr           {self._describe_lr(total)}",
            f"run dir      {self.root_dir}",
            f"resume from  {self.resume or 'nothing (fresh start)'}",
        ]
        if self.timeout is not None:
            lines.append(f"timeout      ranks wait {self.timeout:g} s for each other (--launch.timeout)")
        lines += [f"note: {note}" for note in self.notes]
        return "preflight plan\n" + "\n".join(f"  {line}" for line in lines)


def hpc_checkpoint(root_dir: str | Path) -> Path | None:
    """The ``hpc_ckpt_N.ckpt`` Lightning would auto-resume from under SLURM (highest N in ``root_dir``)."""
    found = sorted(Path(root_dir).glob("hpc_ckpt_*.ckpt"), key=lambda p: int(p.stem.rsplit("_", 1)[-1] or 0))
    return found[-1] if found else None


def build(config: Any, launch: Launch | None = None, timeout: float | None = None) -> Plan:
    """The plan for a parsed subcommand config (LightningCLI's ``config[subcommand]``)."""
    launch = launch or detect()
    trainer = config.trainer
    accelerator = str(trainer.get("accelerator") or "auto")
    root = str(Path(trainer.get("default_root_dir") or ".").resolve())
    resume = config.get("ckpt_path")
    if resume is None and launch.launcher == "slurm" and (hpc := hpc_checkpoint(root)) is not None:
        resume = f"hpc: {hpc} (Lightning resumes from it automatically under SLURM)"
    plan = Plan(
        launch=launch,
        strategy=strategy_name(trainer.get("strategy") or "auto"),
        accelerator=accelerator,
        devices=device_count(trainer.get("devices", "auto"), accelerator),
        num_nodes=int(trainer.get("num_nodes") or 1),
        batch_size=_get(config, "data", "batch_size"),
        global_batch_size=_get(config, "data", "global_batch_size"),
        lr=_get(config, "model", "optimizer", "lr"),
        lr_reference_batch_size=_get(config, "model", "lr_reference_batch_size"),
        precision=str(trainer.get("precision") or "32-true"),
        root_dir=root,
        resume=str(resume) if resume else None,
        timeout=timeout,
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        devices_per_process=devices_per_process(trainer.get("strategy") or "auto"),
    ).check()
    plan.problems += config_problems(config)
    return plan


def preflight(config: Any, timeout: float | None = None, echo: bool = True) -> Plan:
    """Builds and checks the plan; rank 0 prints it. Every rank exits with the fix when the plan has problems."""
    global _last_plan
    plan = _last_plan = build(config, timeout=timeout)
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


def config_problems(config: Any) -> list[str]:
    """Names and numbers in the config that cannot work on any machine, each with its fix (checked at submit, too)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from app.errors import did_you_mean

    problems, trainer = [], config.trainer
    strategy = trainer.get("strategy")
    names = ["auto", *StrategyRegistry.available_strategies()]
    if isinstance(strategy, str) and strategy.lower() not in names:
        hint = did_you_mean(strategy, names)
        names = [n for n in names if "find_unused" not in n and not re.search("deepspeed|fsdp|xla|tpu", n)]
        problems.append(
            f"trainer.strategy {strategy!r} is not a registered strategy{hint}. Fix: one of {', '.join(names)} "
            "(or a Strategy class_path; the app's modes are in the README)."
        )
    accelerator = trainer.get("accelerator")
    accelerators = ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())]
    if isinstance(accelerator, str) and accelerator.lower() not in accelerators:
        problems.append(
            f"trainer.accelerator {accelerator!r} is unknown{did_you_mean(accelerator, accelerators)}. "
            f"Fix: one of {', '.join(accelerators)}."
        )
    for key in ("batch_size", "global_batch_size"):
        value = _get(config, "data", key)
        if isinstance(value, int) and value <= 0:
            problems.append(
                f"data.{key}={value}: a batch is a positive number of images. Fix: e.g. --data.{key} "
                f"{64 if key == 'batch_size' else 256}."
            )
    devices = trainer.get("devices")
    if isinstance(devices, int) and (devices == 0 or devices < -1):
        problems.append(f"trainer.devices={devices}: give a positive count, a list of indices, or auto.")
    return problems


def _unwritable(folder: str | Path) -> str | None:
    """Why nothing can be written under ``folder`` (created if missing), or None. Leaves no file behind."""
    path = Path(folder).resolve()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:  # a real write: permission bits say nothing for root, nor about read-only mounts
        tempfile.TemporaryDirectory(dir=existing, prefix=".preflight-").cleanup()
    except OSError as err:
        return f"cannot create anything in {existing}: {err.strerror or err}"
    return None


def machine_problems(plan: Plan, config: Any, cuda_devices: int | None = None) -> list[str]:
    """What this machine cannot do that the config asks for (GPUs, writable folders); fills ``plan.notes`` too.

    Checked where the run starts (not when a SLURM job is rendered on a login node). ``cuda_devices`` defaults to
    ``torch.cuda.device_count()``.
    """
    import torch

    problems: list[str] = []
    have = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    accelerator = plan.accelerator.lower()
    per_process = plan.devices_per_process
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and have > 0)
    devices = config.trainer.get("devices")
    indices = devices if isinstance(devices, (list, tuple)) else str(devices).split(",") if "," in str(devices) else []
    indices = [int(d) for d in indices if str(d).strip().isdigit()]  # "0,3" / [0, 3]: GPUs 0 and 3 -> 4 must exist
    need = (max(indices) + 1) if indices else (plan.devices or 1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if on_gpu and per_process == 1 and need > have:  # "auto" means the GPUs when there are some
        fix = f"--trainer.devices {have}, or " if have else ""
        problems.append(
            f"trainer.accelerator {plan.accelerator} asks for {need} GPU(s) per node but this machine has {have}"
            f"{visible}. Fix: {fix}--trainer.accelerator cpu (or auto: a GPU when there is one, else the CPU)."
        )
    elif on_gpu and per_process > 1 and (processes := plan.devices or have) * per_process > have:
        fit = have // per_process
        fix = f"--trainer.devices {fit}" if fit else "--trainer.accelerator cpu"
        problems.append(
            f"ddp_mp: trainer.devices counts processes, and {processes} process(es) x devices_per_process "
            f"{per_process} = {processes * per_process} GPUs per node, but this machine has {have}{visible}. "
            f"Fix: {fix} (GPUs / devices_per_process), or a smaller strategy.init_args.devices_per_process."
        )
    elif on_gpu and per_process > 1 and have % per_process:
        plan.notes.append(f"ddp_mp: {have} GPUs do not divide by devices_per_process {per_process}; some stay idle.")
    if plan.is_dp and on_gpu and need > 1 and _get(config, "model", "compile"):
        from app.strategies.dp import COMPILE_REFUSED

        problems.append(COMPILE_REFUSED)
    if plan.precision in ("16-mixed", "16") and not on_gpu:
        # Lightning would warn and quietly train bf16-mixed: not what was asked for, so it stops here
        problems.append(
            f"precision {plan.precision} (fp16 AMP with loss scaling) needs a CUDA GPU; this run is on the CPU. "
            "Fix: --trainer.precision bf16-mixed (bfloat16 autocast, works on CPUs), or run on a GPU."
        )
    folders = {str(plan.root_dir): "trainer.default_root_dir"}  # folder -> the config key that names it
    loggers = config.trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if (save_dir := _get(logger, "save_dir")) is not None:
            name = str(_get(logger, "class_path", default="logger")).rsplit(".", 1)[-1]
            folders.setdefault(str(Path(save_dir).resolve()), f"the {name}'s save_dir")
    for callback in config.trainer.get("callbacks") or []:
        if (dirpath := _get(callback, "dirpath")) is not None:
            name = str(_get(callback, "class_path", default="callback")).rsplit(".", 1)[-1]
            folders.setdefault(str(Path(dirpath).resolve()), f"the {name}'s dirpath")
    for folder, what in folders.items():
        if reason := _unwritable(folder):
            fix = "--trainer.default_root_dir" if what.startswith("trainer") else f"{what} set to"
            problems.append(
                f"{what} {folder} is not writable ({reason}), so no log or checkpoint could be saved. "
                f"Fix: {fix} a folder you can write to."
            )
    return problems


def apply_timeout(strategy: Any, seconds: float | None) -> None:
    """Sets how long the ranks wait for each other (the process-group timeout, rendezvous included).

    Lightning exposes this only as the ``timeout`` argument of ``DDPStrategy`` and its subclasses, which a strategy
    given by name (``--trainer.strategy ddp``) cannot carry; the instantiated strategy keeps it in ``_timeout`` until
    ``setup_environment`` passes it to ``init_process_group``, so it is set there.
    """
    if seconds is not None and hasattr(strategy, "_timeout"):
        strategy._timeout = timedelta(seconds=seconds)


_last_plan: Plan | None = None  # the plan of this process's run, for the rendezvous error message


@contextlib.contextmanager
def rendezvous_errors_explained() -> Iterator[None]:
    """Turns c10d's rendezvous timeouts into a message that says which ranks are missing and what to check."""
    try:
        yield
    except Exception as err:
        import torch.distributed as dist

        if not isinstance(err, getattr(dist, "DistError", ())) or "imed out" not in str(err) or _last_plan is None:
            raise
        plan, launch = _last_plan, _last_plan.launch
        world = launch.world_size if launch.launcher != "none" else plan.world_size
        rank = launch.rank if launch.launcher != "none" else (_int_env(launch, "NODE_RANK") or 0) * (plan.devices or 1)
        env = {**launch.env, **os.environ}  # Lightning fills in MASTER_ADDR/PORT when the launcher did not
        address = f"{env.get('MASTER_ADDR', main_address(launch))}:{env.get('MASTER_PORT', '?')}"
        torch_says = str(err).strip().splitlines()[0][:300]
        joined = re.search(r"(\d+)/(\d+) clients joined", torch_says)
        if rank == 0:
            count = f"only {joined.group(1)} of {joined.group(2)}" if joined else f"not all {world}"
            missing = f"rank 0 waited at {address} for the {world} ranks of the job; {count} arrived"
        else:
            missing = f"rank {rank} never reached rank 0 at {address}: rank 0 did not start, or is unreachable"
        layout = "\n".join(line for line in plan.render().splitlines() if line.startswith("    node"))
        wait = f"{plan.timeout:g} s (--launch.timeout)" if plan.timeout is not None else "the strategy's timeout"
        sys.exit(
            f"error: the ranks did not all meet within {wait}: {missing} (torch: {torch_says}).\n"
            f"Expected layout:\n{layout}\n"
            "Check that every node started its processes (`squeue`/`sacct`, or the torchrun/python command on each "
            "node), that all use the same MASTER_ADDR/MASTER_PORT, and that the port is reachable from every node."
        )


def _int_env(launch: Launch, name: str) -> int | None:
    value = launch.env.get(name)
    return int(value) if value and value.isdigit() else None
