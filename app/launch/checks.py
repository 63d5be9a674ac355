"""The preflight checks: each a small function that returns one problem (a message with its fix) or None.

``LAUNCH_CHECKS`` hold the launcher against the config (any machine: also run when a SLURM job is rendered),
``MACHINE_CHECKS`` what this machine cannot do (where the run starts), :func:`config_problems` the names and numbers
that cannot work anywhere. Each check reads the mode's :class:`~core.layout.Layout`, never its name.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.checkpoint import From
from app.launch.plan import Plan
from app.strategies.dp import COMPILE_REFUSED
from app.strategies.modes import declared_modes
from core.batch import uneven_global_batch
from core.config import get
from core.env import LAUNCHER_NAMES, nvidia_driver
from core.errors import did_you_mean, with_link
from core.layout import layout_of
from core.network import main_address, resolves

FLAG = {"slurm": "--ntasks-per-node", "torchrun": "--nproc_per_node"}
# The oldest Linux driver of each CUDA major version (NVIDIA's minor version compatibility), and the PyTorch build
# `make venv TORCH=...` installs for a driver: the newest CUDA that driver runs.
OLDEST_DRIVER = {13: 580, 12: 525, 11: 450}
BUILD_FOR_DRIVER = ((580, "cu130", "13.0"), (525, "cu126", "12.6"))
NODES_FLAG = {"slurm": "--nodes", "torchrun": "--nnodes"}


def slurm_tasks_cannot_be_told_apart(plan: Plan) -> str | None:
    launch = plan.launch
    if launch.launcher != "slurm" or not launch.ntasks_without_per_node:
        return None
    return (
        f"SLURM started {launch.world_size} tasks with --ntasks but without --ntasks-per-node, so the tasks of "
        "each node cannot be told apart. Fix: submit with `#SBATCH --nodes=N` and "
        "`#SBATCH --ntasks-per-node=T` (T = trainer.devices), e.g. "
        "`python -m tools.slurm submit --nodes N --gpus-per-node T -- fit ...`."
    )


def slurm_batch_script_itself(plan: Plan) -> str | None:
    launch = plan.launch
    if launch.launcher != "slurm" or not (launch.in_batch_step and launch.multi_task):
        return None
    return (
        f"this process is the SLURM batch script itself: the job has {launch.world_size} tasks but only this "
        f"one was started, and it would wait for the other {launch.world_size - 1} forever. "
        "Fix: start the training with `srun python cli.py ...` inside the batch script."
    )


def one_process_mode_launched_many(plan: Plan) -> str | None:
    launch = plan.launch
    if not plan.layout.one_process or not (launch.multi_task or plan.num_nodes > 1):
        return None
    started = f"{launch.launcher} started {launch.world_size} processes" if launch.multi_task else ""
    nodes = f"trainer.num_nodes={plan.num_nodes}" if plan.num_nodes > 1 else ""
    return with_link(
        f"strategy {plan.strategy} drives every device of ONE node from ONE process, but {started or nodes}. "
        f"Fix: launch a single process (`python cli.py fit --trainer.strategy {plan.strategy}`, `srun "
        "--ntasks-per-node=1 --nodes=1`, `torchrun --nproc_per_node=1`), or use `--trainer.strategy ddp` (or "
        "allreduce) for one process per device.",
        "dp-one-process",
    )


def tasks_per_node_differ(plan: Plan) -> str | None:
    kind, per_node, expected = plan.launch.launcher, plan.launch.tasks_per_node, plan.layout.processes_per_node
    if kind not in FLAG or plan.layout.one_process or per_node is None or expected is None or per_node == expected:
        return None
    return (
        f"{LAUNCHER_NAMES[kind]} starts {per_node} tasks per node ({FLAG[kind]} {per_node}) but "
        f"trainer.devices={plan.devices}; each task drives exactly one device. "
        f"Fix: `--trainer.devices {per_node}`, or launch with {FLAG[kind]} {expected}."
    )


def nodes_differ(plan: Plan) -> str | None:
    kind, nodes = plan.launch.launcher, plan.launch.nodes
    if kind not in FLAG or plan.layout.one_process or nodes is None or nodes == plan.num_nodes:
        return None
    if plan.launch.node_range:  # torchrun --nnodes MIN:MAX: the round's nodes, not the config, make the world
        return None
    return (
        f"{LAUNCHER_NAMES[kind]} runs on {nodes} node(s) ({NODES_FLAG[kind]} {nodes}) but "
        f"trainer.num_nodes={plan.num_nodes}. Fix: `--trainer.num_nodes {nodes}`, or launch with "
        f"{NODES_FLAG[kind]} {plan.num_nodes}."
    )


def nodes_cannot_meet(plan: Plan) -> str | None:
    if plan.launch.launcher != "none" or plan.num_nodes <= 1 or plan.launch.master_addr is not None:
        return None
    return (
        f"trainer.num_nodes={plan.num_nodes} but no launcher was detected and MASTER_ADDR is not set, so the "
        "nodes cannot find each other. Fix: launch with `srun` (see `python -m tools.slurm submit`) or "
        f"`torchrun --nnodes {plan.num_nodes} --node_rank R --master_addr HOST ...`, or export MASTER_ADDR, "
        "MASTER_PORT and NODE_RANK on every node."
    )


def global_batch_does_not_split(plan: Plan) -> str | None:
    world, given = plan.launched_world_size, plan.global_batch_size
    if given is None or not world:
        return None
    problem = uneven_global_batch(given, world, plan.accumulate, plan.num_nodes)
    return with_link(problem, "global-batch-size") if problem else None


def rendezvous_host_unresolved(plan: Plan) -> str | None:
    launch = plan.launch
    address = main_address(launch)
    if launch.launcher != "slurm" or not launch.multi_task or not address or resolves(address):
        return None
    source = "MASTER_ADDR" if launch.master_addr is not None else "the first node of SLURM_JOB_NODELIST"
    here = launch.slurm_node or "this node"
    return (
        f"the rendezvous host {address!r} ({source}) does not resolve on {here}; "
        "c10d would retry it forever. Fix: export MASTER_ADDR=<an address of the first node that every node "
        "can reach> in the batch script."
    )


def fresh_job_resumes_hpc_checkpoint(plan: Plan) -> str | None:
    launch = plan.launch
    hpc = plan.resume is not None and plan.resume.source is From.HPC
    if launch.launcher != "slurm" or launch.restart_count != 0 or not hpc:
        return None
    return (
        "a fresh SLURM job resumes from an HPC checkpoint an earlier preempted job left in "
        f"{plan.root_dir}; delete it, or use another --trainer.default_root_dir, to start from scratch."
    )


def batch_split_over_devices(plan: Plan) -> str | None:
    if not plan.layout.splits_batch or (plan.devices or 1) <= 1:
        return None
    return (
        f"{plan.strategy}: data.batch_size={plan.batch_size} is per process and split across the {plan.devices} "
        "devices."
    )


def sync_batchnorm_in_one_process(plan: Plan) -> str | None:
    if not plan.sync_batchnorm or not plan.layout.one_process:
        return None
    return (
        f"trainer.sync_batchnorm with strategy {plan.strategy}: SyncBatchNorm synchronises BatchNorm between "
        f"processes, but {plan.strategy} runs ONE process whose per-GPU replicas are threads (torch's SyncBatchNorm "
        "does not support DataParallel), so each GPU would still normalise by its own slice of the batch. Fix: "
        "--trainer.strategy ddp (one process per GPU) with --trainer.sync_batchnorm true, or drop "
        "--trainer.sync_batchnorm."
    )


def sync_batchnorm_alone(plan: Plan) -> str | None:
    if not plan.sync_batchnorm or plan.layout.one_process or plan.launched_world_size != 1:
        return None
    return "trainer.sync_batchnorm has no effect in a single process: BatchNorm already sees the whole batch."


def deprecated_launcher(plan: Plan) -> str | None:
    if not plan.launch.legacy_launch:
        return None
    each_node = " on each node, with its --node_rank" if (plan.launch.nodes or 1) > 1 else ""
    return (
        "python -m torch.distributed.launch is deprecated (PyTorch will remove it) but works here: --local-rank is "
        "accepted, the ranks come from the LOCAL_RANK, RANK and WORLD_SIZE it sets. The same job with "
        f"torchrun{each_node}: {plan.launch.legacy_launch}"
    )


LAUNCH_CHECKS: list[Callable[[Plan], str | None]] = [
    slurm_tasks_cannot_be_told_apart,
    slurm_batch_script_itself,
    one_process_mode_launched_many,
    tasks_per_node_differ,
    nodes_differ,
    nodes_cannot_meet,
    global_batch_does_not_split,
    rendezvous_host_unresolved,
    sync_batchnorm_in_one_process,
]
LAUNCH_NOTES: list[Callable[[Plan], str | None]] = [
    fresh_job_resumes_hpc_checkpoint,
    batch_split_over_devices,
    sync_batchnorm_alone,
    deprecated_launcher,
]


def launch_problems(plan: Plan) -> list[str]:
    """Every disagreement between launcher and config, each with its fix; fills ``plan.notes`` too."""
    plan.notes += [note for check in LAUNCH_NOTES if (note := check(plan))]
    return [problem for check in LAUNCH_CHECKS if (problem := check(plan))]


def config_problems(config: Any) -> list[str]:
    """Names and numbers in the config that cannot work on any machine, each with its fix (checked at submit, too)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    problems, trainer = [], config.trainer
    strategy = trainer.get("strategy")
    names = ["auto", *StrategyRegistry.available_strategies()]
    if isinstance(strategy, str) and strategy.lower() not in names:
        hint = did_you_mean(strategy, names)
        names = ["auto", *declared_modes()]  # the app's modes; any other registered name or class_path works too
        if strategy.lower() == "horovod":  # Lightning 2.0 removed its HorovodStrategy; old tutorials still use it
            hint = " (Lightning 2 has no Horovod; allreduce does what hvd.DistributedOptimizer did, see the README)"
        problems.append(
            with_link(
                f"trainer.strategy {strategy!r} is not a registered strategy{hint}. Fix: one of {', '.join(names)} "
                "(or another registered name, or a Strategy class_path; the modes are in the README).",
                "unknown-strategy",
            )
        )
    accelerator = trainer.get("accelerator")
    accelerators = ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())]
    if isinstance(accelerator, str) and accelerator.lower() not in accelerators:
        problems.append(
            with_link(
                f"trainer.accelerator {accelerator!r} is unknown{did_you_mean(accelerator, accelerators)}. "
                f"Fix: one of {', '.join(accelerators)}.",
                "unknown-accelerator",
            )
        )
    for key in ("batch_size", "global_batch_size"):
        value = get(config, "data", key)
        if isinstance(value, int) and value <= 0:
            problems.append(
                with_link(
                    f"data.{key}={value}: a batch is a positive number of images. Fix: e.g. --data.{key} "
                    f"{64 if key == 'batch_size' else 256}.",
                    "batch-size",
                )
            )
    workers = get(config, "data", "num_workers")
    if isinstance(workers, int) and workers < 0:
        problems.append(
            f"data.num_workers={workers}: a count of loader processes. Fix: --data.num_workers 0 (load in the "
            "training process), a positive count, or auto (this node's CPUs shared by its training processes)."
        )
    devices = trainer.get("devices")
    if isinstance(devices, int) and (devices == 0 or devices < -1):
        problems.append(f"trainer.devices={devices}: give a positive count, a list of indices, or auto.")
    # the classes' own checks of their arguments, before they are built: an error raised while jsonargparse builds
    # one would arrive inside its union's long message, with a traceback
    return problems + data_problems(config) + list(layout_of(strategy).problems)


def data_class(config: Any) -> Any:
    """The DataModule class ``data.class_path`` names, imported (its ``plan_lines`` go to the plan); None without one
    or for an unknown class (the parser says so)."""
    import importlib

    module, _, name = str(getattr(config.get("data"), "class_path", "") or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def data_problems(config: Any) -> list[str]:
    """The DataModule's own checks of its ``init_args`` (``core.datamodule.ImageData.config_problems``; a class without
    one has none)."""
    check = getattr(data_class(config), "config_problems", None)
    return list(check(config.get("data").get("init_args") or {})) if callable(check) else []


@dataclass
class Machine:
    """What the machine checks need to know: this machine's GPUs and what the config asks of them."""

    plan: Plan
    config: Any
    have: int  # CUDA devices visible here
    on_gpu: bool
    need: int  # GPUs per node the device list asks for ("0,3": 4 must exist)
    visible: str  # " (CUDA_VISIBLE_DEVICES=...)" or ""

    @property
    def per_process(self) -> int:
        """GPUs each process needs of its own (``ddp_mp``: its stages); 1 for every other layout."""
        layout = self.plan.layout
        return layout.devices_per_process if layout.needs_process_gpus else 1

    @classmethod
    def of(cls, plan: Plan, config: Any, cuda_devices: int | None = None) -> Machine:
        import torch

        have = torch.cuda.device_count() if cuda_devices is None else cuda_devices
        accelerator = plan.accelerator.lower()
        on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and have > 0)  # auto: the GPUs if any
        devices = config.trainer.get("devices")
        text = str(devices)
        listed = devices if isinstance(devices, (list, tuple)) else text.split(",") if "," in text else []
        indices = [int(d) for d in listed if str(d).strip().isdigit()]
        need = (max(indices) + 1) if indices else (plan.devices or 1)
        visible = plan.launch.cuda_visible_devices
        visible = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return cls(plan, config, have, on_gpu, need, visible)


def driver_without_gpu(have: int) -> str | None:
    """One line when an NVIDIA driver is present but torch sees no GPU (``have`` 0): the driver's version, the CUDA
    version this torch was built for, and the command that installs a build this driver runs. Lightning alone says
    only that no GPU is available, and ``accelerator auto`` quietly trains on the CPU."""
    if have or (driver := nvidia_driver()) is None:
        return None
    import torch

    major = int(driver.split(".")[0])
    built = torch.version.cuda
    needs = OLDEST_DRIVER.get(int(built.split(".")[0])) if built else None
    head = f"NVIDIA driver {driver} is present but torch sees no GPU"
    if built and needs is not None and major >= needs:  # the build fits: the GPU is hidden from this process
        return (
            f"{head}, although this torch (CUDA {built}) runs on that driver. Fix: check that this process may use "
            "a GPU (nvidia-smi; CUDA_VISIBLE_DEVICES)."
        )
    if built:
        why = f"this torch is built for CUDA {built}, which needs driver {needs} or newer"
    else:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    match = next(((build, cuda) for oldest, build, cuda in BUILD_FOR_DRIVER if major >= oldest), None)
    if match is None:
        return f"{head}: {why}, and no PyTorch build here runs on a driver older than 525. Fix: update the driver."
    build, cuda = match
    return f"{head}: {why}. Fix: make venv TORCH={build} (PyTorch's CUDA {cuda} build), or update the driver."


def too_few_gpus(m: Machine) -> str | None:
    if not m.on_gpu or m.per_process != 1 or m.need <= m.have:
        return None
    if driver := driver_without_gpu(m.have):  # the reason there is none: the driver and this torch do not fit
        return with_link(driver, "gpu-driver")
    fix = f"--trainer.devices {m.have}, or " if m.have else ""
    return with_link(
        f"trainer.accelerator {m.plan.accelerator} asks for {m.need} GPU(s) per node but this machine has {m.have}"
        f"{m.visible}. Fix: {fix}--trainer.accelerator cpu (or auto: a GPU when there is one, else the CPU).",
        "no-gpu",
    )


def too_few_gpus_for_the_processes(m: Machine) -> str | None:
    processes, k = m.plan.devices or m.have, m.per_process
    if not m.on_gpu or k == 1 or processes * k <= m.have:
        return None
    fit = m.have // k
    fix = f"--trainer.devices {fit}" if fit else "--trainer.accelerator cpu"
    return with_link(
        f"{m.plan.strategy}: trainer.devices counts processes, and {processes} process(es) x devices_per_process "
        f"{k} = {processes * k} GPUs per node, but this machine has {m.have}{m.visible}. "
        f"Fix: {fix} (GPUs / devices_per_process), or a smaller strategy.init_args.devices_per_process.",
        "ddp-mp-gpus",
    )


def compile_refused(m: Machine) -> str | None:
    if not (m.plan.layout.splits_batch and m.on_gpu and m.need > 1 and get(m.config, "model", "compile") is True):
        return None
    return COMPILE_REFUSED


def fp16_needs_a_gpu(m: Machine) -> str | None:
    if m.plan.precision not in ("16-mixed", "16") or m.on_gpu:
        return None
    # Lightning would warn and quietly train bf16-mixed: not what was asked for, so it stops here
    return with_link(
        f"precision {m.plan.precision} (fp16 AMP with loss scaling) needs a CUDA GPU; this run is on the CPU. "
        "Fix: --trainer.precision bf16-mixed (bfloat16 autocast, works on CPUs), or run on a GPU.",
        "fp16-on-cpu",
    )


def backend_unavailable(m: Machine) -> str | None:
    import torch
    import torch.distributed as dist

    backend = get(m.config, "trainer", "strategy", "process_group_backend")
    if backend is None:
        return None
    name, known = str(backend).lower(), dist.Backend.backend_list
    fix = "Fix: --trainer.strategy.process_group_backend gloo on CPUs or nccl on GPUs (or unset: Lightning picks them)"
    if name == "nccl" and not m.on_gpu:  # Lightning would fail in the first collective with a traceback
        return f"process_group_backend nccl needs CUDA GPUs, and this run is on the CPU. {fix}."
    if name not in known:
        return f"process_group_backend {name!r} is not a torch.distributed backend{did_you_mean(name, known)}. {fix}."
    if dist.is_available() and dist.is_backend_available(name):
        return None
    # MPI (Horovod's usual transport) is in none of the official PyTorch wheels: it needs a build from source
    built = "from source on a host with MPI" if name == "mpi" else f"with {name}"
    return (
        f"process_group_backend {name}: this PyTorch ({torch.__version__}) was built without it. {fix}, "
        f"or a PyTorch built {built}."
    )


def driver_note(m: Machine) -> str | None:
    return None if m.on_gpu else driver_without_gpu(m.have)  # asked for a GPU: too_few_gpus stops with the line


def idle_gpus(m: Machine) -> str | None:
    k = m.per_process
    if not m.on_gpu or k == 1 or too_few_gpus_for_the_processes(m) or m.have % k == 0:
        return None
    return f"{m.plan.strategy}: {m.have} GPUs do not divide by devices_per_process {k}; some stay idle."


MACHINE_CHECKS: list[Callable[[Machine], str | None]] = [
    too_few_gpus,
    too_few_gpus_for_the_processes,
    compile_refused,
    fp16_needs_a_gpu,
    backend_unavailable,
]
MACHINE_NOTES: list[Callable[[Machine], str | None]] = [idle_gpus, driver_note]


def unwritable(folder: str | Path) -> str | None:
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


def output_folders(plan: Plan, config: Any) -> dict[str, str]:
    """Every folder the run writes to -> the config key that names it."""
    folders = {str(plan.root_dir): "trainer.default_root_dir"}
    loggers = config.trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if (save_dir := get(logger, "save_dir")) is not None:
            name = str(get(logger, "class_path", default="logger")).rsplit(".", 1)[-1]
            folders.setdefault(str(Path(save_dir).resolve()), f"the {name}'s save_dir")
    if (dirpath := get(config, "checkpoint", "dirpath")) is not None:  # the --checkpoint group
        folders.setdefault(str(Path(dirpath).resolve()), "checkpoint.dirpath")
    for callback in config.trainer.get("callbacks") or []:
        if (dirpath := get(callback, "dirpath")) is not None:
            name = str(get(callback, "class_path", default="callback")).rsplit(".", 1)[-1]
            folders.setdefault(str(Path(dirpath).resolve()), f"the {name}'s dirpath")
    return folders


def unwritable_folders(plan: Plan, config: Any) -> list[str]:
    problems = []
    for folder, what in output_folders(plan, config).items():
        if reason := unwritable(folder):
            fix = "--trainer.default_root_dir" if what.startswith("trainer") else f"{what} set to"
            problem = (
                f"{what} {folder} is not writable ({reason}), so no log or checkpoint could be saved. "
                f"Fix: {fix} a folder you can write to."
            )
            # the run folder's own section; the others (a logger's save_dir) link to the preflight's
            problems.append(
                with_link(problem, "root-dir-not-writable") if what == "trainer.default_root_dir" else problem
            )
    return problems


def machine_problems(plan: Plan, config: Any, cuda_devices: int | None = None) -> list[str]:
    """What this machine cannot do that the config asks for (GPUs, writable folders); fills ``plan.notes`` too.

    Checked where the run starts (not when a SLURM job is rendered on a login node). ``cuda_devices`` defaults to
    ``torch.cuda.device_count()``.
    """
    machine = Machine.of(plan, config, cuda_devices)
    plan.notes += [note for check in MACHINE_NOTES if (note := check(machine))]
    problems = [problem for check in MACHINE_CHECKS if (problem := check(machine))]
    return problems + unwritable_folders(plan, config)
