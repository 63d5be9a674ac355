"""Which launcher started this process, and the layout it promises: the one reader of the environment.

Every variable that torchrun, SLURM, the elastic agent, Lightning or the app itself sets, and the few a user sets for
the app (W&B's, ``DPTRAIN_DOCS_URL``), is read here into a frozen record (:class:`Launch`, :class:`Wandb`); the rest of
the app is handed the record and never reads ``os.environ`` itself. A record is read when it is needed
(:func:`detect`): some variables appear only later in a run (Lightning exports ``MASTER_ADDR``/``MASTER_PORT`` when it
forms the process group), so the hang watch reads its record when its thread starts, not at the command's start.

``python -m torch.distributed.launch`` (deprecated, in every old tutorial) runs torchrun's agent, sets the same
variables and adds ``--local-rank=K`` to the script's arguments: :func:`split_local_rank` takes the flag out before
the command line is parsed, and :func:`detect` reports such a job as torchrun with the equivalent torchrun command.

Lightning's cluster environments (``SLURMEnvironment``, ``TorchElasticEnvironment``) read the same variables later,
when the Trainer is built; this module reads them earlier, without side effects, so the preflight plan can compare
them with the config before any process group exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# what torch.distributed.launch passes (torch >= 2.0: --local-rank=K; before: --local_rank=K); also "--local_rank K"
LOCAL_RANK_FLAG = re.compile(r"--local[-_]rank(?:=(\d+))?$")
REQUEUE_BY = "DPTRAIN_REQUEUE_BY"  # set to "script" by the batch script of tools.slurm submit (tools/sbatch.py)
LAUNCHER_NAMES = {"none": "none (Lightning starts the local processes)", "torchrun": "torchrun", "slurm": "SLURM"}


@dataclass(frozen=True)
class Launch:
    """What the launcher says about this job. Counts are None when the launcher does not tell.

    Attributes:
        launcher: ``"none"`` (plain ``python cli.py``; Lightning starts the local processes itself), ``"torchrun"``
            or ``"slurm"``.
        nodes: number of nodes the launcher started.
        tasks_per_node: processes per node (SLURM ``--ntasks-per-node``, torchrun ``--nproc_per_node``).
        world_size: processes in the whole job.
        rank: this process's global rank.
        node_rank: this process's node index.
        hosts: node host names in node order (SLURM), or just this host.
        cpus_per_task: CPUs SLURM gave each task (``--cpus-per-task``), None when it does not say.
        legacy_launch: set when the deprecated ``python -m torch.distributed.launch`` started this job (``launcher``
            is then ``"torchrun"``: the same agent and variables): the same job as a torchrun command.
        job_id: SLURM's job id, or torchrun's ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; random with ``--standalone``).
        restart_count: SLURM requeues, or torchrun restarts of the worker group so far (``TORCHELASTIC_RESTART_COUNT``).
        max_restarts: torchrun's ``--max-restarts`` (``TORCHELASTIC_MAX_RESTARTS``); 0 elsewhere.
        node_range: torchrun's ``--nnodes MIN:MAX`` when MIN < MAX (elastic), else None.
        master_addr: ``MASTER_ADDR`` (the launcher's, or Lightning's once it formed the process group).
        master_port: ``MASTER_PORT``, likewise.
        agent_store: torchrun's agent serves its store to the workers (``TORCHELASTIC_USE_AGENT_STORE=True``).
        step_tasks: the processes ``srun`` started for this step (``SLURM_STEP_NUM_TASKS``); None outside ``srun``.
        world_size_var: ``WORLD_SIZE`` as set (torchrun's, or Lightning's for the processes its launcher starts),
            whatever the launcher; None when unset.
        slurm_job: ``SLURM_JOB_ID`` (also outside a SLURM launch: an ``salloc`` shell): what a requeued job's
            checkpoints are recognised by.
        torchrun_job: ``TORCHELASTIC_RUN_ID``: what a restarted worker group's checkpoints are recognised by.
        requeue_by_script: the batch script of ``python -m tools.slurm submit`` requeues the job after a fault
            (``DPTRAIN_REQUEUE_BY=script``), so the app leaves it to it.
        node_storage: the node's own storage the scheduler names (``$SLURM_TMPDIR``, ``$TMPDIR``), in that order.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` as set (for messages), None when unset.
        slurm_node: this node's name as SLURM knows it (``SLURMD_NODENAME``), None outside a SLURM step.
        array_job: the job array's id (``SLURM_ARRAY_JOB_ID``) when this job is one task of an array (a grid of
            ``python -m tools.slurm submit --grid``), else None; ``slurm_job`` is then the task's own job id.
        array_task: the task's index in its array (``SLURM_ARRAY_TASK_ID``), else None.
        env: the variables the layout was read from (for messages).
    """

    launcher: str = "none"
    nodes: int | None = None
    tasks_per_node: int | None = None
    world_size: int | None = None
    rank: int = 0
    node_rank: int = 0
    hosts: tuple[str, ...] = ()
    ntasks_without_per_node: bool = False
    in_batch_step: bool = False
    job_id: str | None = None
    restart_count: int = 0
    cpus_per_task: int | None = None
    legacy_launch: str | None = None
    max_restarts: int = 0
    node_range: tuple[int, int] | None = None
    master_addr: str | None = None
    master_port: str | None = None
    agent_store: bool = False
    step_tasks: int | None = None
    world_size_var: int | None = None
    slurm_job: str | None = None
    torchrun_job: str | None = None
    requeue_by_script: bool = False
    node_storage: tuple[str, ...] = ()
    cuda_visible_devices: str | None = None
    slurm_node: str | None = None
    array_job: str | None = None
    array_task: int | None = None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def slurm_requeue_id(self) -> str | None:
        """What ``scontrol requeue`` takes for this job: ``ARRAYJOB_TASK`` for a task of an array, whose own job id may
        be the array's (one task's id is; ``scontrol`` takes it for every task of the array), else ``slurm_job``."""
        if self.array_job and self.array_task is not None:
            return f"{self.array_job}_{self.array_task}"
        return self.slurm_job

    @property
    def multi_task(self) -> bool:
        """True when the launcher started more than one process for this job."""
        return (self.world_size or 1) > 1


def node_name() -> str:
    """This node's name as the scheduler knows it (SLURM's ``SLURMD_NODENAME``: what ``sbatch --exclude`` takes), else
    the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _int(value: str | None) -> int | None:
    # SLURM writes repeated counts as "2(x3)"; the first number is the per-node value
    match = re.match(r"\d+", value or "")
    return int(match.group()) if match else None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands SLURM's compressed host list (``n[1-3,7],gpu01``) the way ``scontrol show hostnames`` does."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            hosts.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1))
    return hosts


def split_local_rank(args: Sequence[str]) -> tuple[list[str], str | None]:
    """``args`` without torch.distributed.launch's ``--local-rank=K`` (or ``--local_rank=K``, ``--local_rank K``),
    and K (None when the flag is absent)."""
    kept, rank, rest = [], None, iter(args)
    for arg in rest:
        match = LOCAL_RANK_FLAG.match(arg)
        if match is None:
            kept.append(arg)
        else:
            rank = match.group(1) or next(rest, None)
    return kept, rank


def parent_command() -> list[str]:
    """The command line of the process that started this one (Linux ``/proc``; empty elsewhere).

    torchrun's agent, and so torch.distributed.launch, starts the workers itself: for them this is the launch command.
    """
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def legacy_launch(env: Mapping[str, str], argv: Sequence[str], parent: Sequence[str]) -> str | None:
    """The torchrun command equivalent to the torch.distributed.launch command that started this worker, or None.

    Recognised by the ``--local-rank`` flag in ``argv`` or, with ``--use-env`` (no flag), by the parent's command
    line: both launchers set exactly the same variables. The equivalent is the parent's command with ``torchrun`` in
    place of ``python -m torch.distributed.launch`` and without ``--use-env`` (torchrun's behaviour); without the
    parent's command it is rebuilt from the variables.
    """
    flag = any(LOCAL_RANK_FLAG.match(arg) for arg in argv)
    if "torch.distributed.launch" in parent:
        options = parent[parent.index("torch.distributed.launch") + 1 :]
        return shlex.join(["torchrun", *(o for o in options if o not in ("--use-env", "--use_env"))])
    if not flag:
        return None
    script, _ = split_local_rank(argv)
    layout = {
        "--nnodes": env.get("GROUP_WORLD_SIZE", "1"),
        "--nproc_per_node": env.get("LOCAL_WORLD_SIZE", "1"),
        "--node_rank": env.get("GROUP_RANK", "0"),
        "--master_addr": env.get("MASTER_ADDR"),
        "--master_port": env.get("MASTER_PORT"),
    }
    options = [f"{key}={value}" for key, value in layout.items() if value is not None]
    return shlex.join(["torchrun", *options, *script])


def detect(
    environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None, parent: Sequence[str] | None = None
) -> Launch:
    """Reads the launcher's variables from ``environ`` (default ``os.environ``).

    SLURM is detected the way Lightning's ``SLURMEnvironment.detect`` does it (``SLURM_NTASKS`` set and the job not
    named ``bash``/``interactive``), torchrun by ``TORCHELASTIC_RUN_ID`` (as ``dist.is_torchelastic_launched`` does),
    torch.distributed.launch as torchrun plus :func:`legacy_launch` (``argv``: default ``sys.argv``; ``parent``:
    default :func:`parent_command`).
    """
    env = dict(os.environ if environ is None else environ)
    common = {  # the same whichever launcher started the job
        "master_addr": env.get("MASTER_ADDR"),
        "master_port": env.get("MASTER_PORT"),
        "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        "step_tasks": _int(env.get("SLURM_STEP_NUM_TASKS")),
        "world_size_var": _int(env.get("WORLD_SIZE")),
        "slurm_job": env.get("SLURM_JOB_ID") or None,
        "torchrun_job": env.get("TORCHELASTIC_RUN_ID") or None,
        "requeue_by_script": env.get(REQUEUE_BY) == "script",
        "node_storage": tuple(v for v in (env.get("SLURM_TMPDIR"), env.get("TMPDIR")) if v),
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "slurm_node": env.get("SLURMD_NODENAME") or None,
        "array_job": env.get("SLURM_ARRAY_JOB_ID") or None,
        "array_task": _int(env.get("SLURM_ARRAY_TASK_ID")),
        "env": env,
    }
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return _slurm(env, common)
    if "TORCHELASTIC_RUN_ID" in env:
        launch = legacy_launch(env, sys.argv if argv is None else argv, parent_command() if parent is None else parent)
        # the agent's command line is this process's parent only when the environment is this process's own
        return _torchrun(env, common, launch, torchrun_node_range() if environ is None else None)
    # plain `python cli.py` on each node (Lightning's own launcher): NODE_RANK says which node this is
    return Launch(node_rank=_int(env.get("NODE_RANK")) or 0, hosts=(socket.gethostname(),), **common)


def _slurm(env: Mapping[str, str], common: dict[str, Any]) -> Launch:
    """A SLURM job's layout, from the variables ``srun`` and ``sbatch`` set."""
    ntasks = _int(env.get("SLURM_NTASKS"))
    per_node = _int(env.get("SLURM_NTASKS_PER_NODE"))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return Launch(
        launcher="slurm",
        nodes=_int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")),
        tasks_per_node=per_node,
        world_size=ntasks,
        rank=_int(env.get("SLURM_PROCID")) or 0,
        node_rank=_int(env.get("SLURM_NODEID")) or 0,
        hosts=tuple(expand_nodelist(nodelist)),
        ntasks_without_per_node=(ntasks or 1) > 1 and per_node is None,
        # srun sets SLURM_STEP_ID for the tasks it starts; the batch script itself has none
        in_batch_step="SLURM_STEP_ID" not in env,
        job_id=env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID"),
        restart_count=_int(env.get("SLURM_RESTART_COUNT")) or 0,
        cpus_per_task=_int(env.get("SLURM_CPUS_PER_TASK")),
        **common,
    )


def _torchrun(
    env: Mapping[str, str], common: dict[str, Any], legacy: str | None, node_range: tuple[int, int] | None
) -> Launch:
    """A torchrun worker's layout, from the variables its agent sets."""
    world = _int(env.get("WORLD_SIZE"))
    per_node = _int(env.get("LOCAL_WORLD_SIZE"))
    return Launch(
        launcher="torchrun",
        nodes=world // per_node if world and per_node else None,
        tasks_per_node=per_node,
        world_size=world,
        rank=_int(env.get("RANK")) or 0,
        node_rank=_int(env.get("GROUP_RANK")) or 0,
        hosts=(socket.gethostname(),),
        legacy_launch=legacy,
        job_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int(env.get("TORCHELASTIC_RESTART_COUNT")) or 0,
        max_restarts=_int(env.get("TORCHELASTIC_MAX_RESTARTS")) or 0,
        node_range=node_range,
        **common,
    )


def torchrun_node_range(agent_pid: int | None = None) -> tuple[int, int] | None:
    """torchrun's ``--nnodes MIN:MAX`` when it is a range, read from the agent's command line with torch's own parser.

    The agent tells its workers the nodes of this round only (``WORLD_SIZE``), not the range it accepts, so the range
    is read where torchrun got it: the command line of the worker's parent, the agent (``agent_pid``; Linux ``/proc``).
    None when that cannot be read or ``--nnodes`` is a single number.
    """
    try:
        argv = Path(f"/proc/{agent_pid or os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        return None
    start = next((i + 1 for i, arg in enumerate(argv) if arg == "torch.distributed.run" or arg.endswith("torchrun")), 0)
    if not start:
        return None
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text on a command it cannot parse
            nodes = get_args_parser().parse_args(argv[start:]).nnodes
        low, high = parse_min_max_nnodes(nodes)
    except (SystemExit, ValueError, RuntimeError):
        return None
    return (low, high) if low < high else None


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux: ``/proc/self/stat``'s start time against the boot clock), so
    that a run can say what it cost, imports included; None where that is not available."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the fields after the command name, from field 3 on
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in clock ticks after boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# what the NVIDIA kernel module writes its version to: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ..."
NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version on this machine (``550.54.15``), or None when it has none.

    Read from the kernel module's file (``DPTRAIN_NVIDIA_VERSION_FILE`` names another one: a container that mounts it
    elsewhere, or a test), else asked of ``nvidia-smi`` when it is on the PATH.
    """
    try:
        text = Path(os.environ.get("DPTRAIN_NVIDIA_VERSION_FILE", NVIDIA_VERSION_FILE)).read_text()
    except OSError:
        text = ""
    if found := re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text):
        return found.group(1)
    if text or shutil.which("nvidia-smi") is None:  # a file we cannot read as a version: no guess from elsewhere
        return None
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return answer[0] if answer and re.fullmatch(r"\d+\.\d+(\.\d+)?", answer[0]) else None


# A user's own Inductor cache folder, read when this module is first imported (before anything compiles): Inductor
# writes its default folder into the same variable the first time it compiles, after which it cannot be told apart.
_USER_COMPILE_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def compile_cache(folder: str | Path) -> Path:
    """The folder ``torch.compile`` keeps its caches in (Inductor's FX graphs, AOTAutograd's and the autotuning
    results; Triton's kernels inside it): the user's ``TORCHINDUCTOR_CACHE_DIR`` when set, else ``folder``, set here
    for this process before its first compile. A restart or requeued job that finds it compiles nothing again."""
    if _USER_COMPILE_CACHE:
        return Path(_USER_COMPILE_CACHE)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(folder).resolve())
    return Path(folder).resolve()


def set_default(name: str, value: str) -> str:
    """Sets ``name`` in this process's environment unless the user did; returns the value in effect."""
    return os.environ.setdefault(name, value)


@dataclass(frozen=True)
class Wandb:
    """What W&B's own variables say (``WANDB_*``; wandb reads them again itself, this is for the app's decisions).

    Attributes:
        has_key: ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE`` is set.
        base_url: ``WANDB_BASE_URL`` (the server), None when unset.
        netrc: ``NETRC`` (where ``wandb login`` wrote the key), None when unset.
        mode: ``WANDB_MODE`` in lower case, empty when unset.
        project: ``WANDB_PROJECT``, None when unset.
        run_group: ``WANDB_RUN_GROUP``, None when unset.
    """

    has_key: bool = False
    base_url: str | None = None
    netrc: str | None = None
    mode: str = ""
    project: str | None = None
    run_group: str | None = None


def wandb(environ: Mapping[str, str] | None = None) -> Wandb:
    """Reads W&B's variables from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return Wandb(
        has_key=bool(env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE")),
        base_url=env.get("WANDB_BASE_URL") or None,
        netrc=env.get("NETRC") or None,
        mode=env.get("WANDB_MODE", "").strip().lower(),
        project=env.get("WANDB_PROJECT") or None,
        run_group=env.get("WANDB_RUN_GROUP") or None,
    )


def global_seed() -> int | None:
    """The seed ``seed_everything`` exported for the processes it starts (``PL_GLOBAL_SEED``), None when unset."""
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value else None


def docs_url() -> str:
    """Where the error lines link to: ``DPTRAIN_DOCS_URL`` (a docs site's troubleshooting page), else the page in
    this repository."""
    return os.environ.get("DPTRAIN_DOCS_URL", "docs/troubleshooting.md")


def export_unset(values: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets each of ``values`` in ``environ`` (default ``os.environ``) that is not set there already (a user's own
    value wins), for what reads it later: torch and NCCL when the process group forms, the processes Lightning's
    launcher starts (they inherit the environment). Returns the variables set."""
    environ = os.environ if environ is None else environ
    made = {k: v for k, v in values.items() if k not in environ}
    environ.update(made)
    return made


def slurm_task() -> tuple[int, int]:
    """This task's index and the step's task count under ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``); (0, 1)
    elsewhere: for tools that split their work over the tasks of a step."""
    return _int(os.environ.get("SLURM_PROCID")) or 0, _int(os.environ.get("SLURM_NTASKS")) or 1
