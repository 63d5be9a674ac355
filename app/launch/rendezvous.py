"""The ranks meeting each other: how long they wait, and what a rendezvous timeout means for this run's plan."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from app.faults import Fault
from app.launch.plan import Plan
from app.lightning_private import init_dist_connection, process_group_backend, set_strategy_timeout, strategy_timeout
from core.env import Launch, detect
from core.network import main_address


class RendezvousTimeout(Fault):
    """The ranks did not all meet: which ranks of the plan are missing, and what to check."""

    help = "rendezvous-timeout"


class HeldPort:
    """The rendezvous port of a one-node multi-process run that Lightning's own launcher starts: bound by
    :meth:`hold` and kept bound until :meth:`release`, exported as ``MASTER_PORT`` for the ranks Lightning starts.
    The command holds one for its run.

    Why by hand: Lightning picks ``MASTER_PORT`` by binding port 0 and closing the socket (``find_free_network_port``),
    and rank 0's TCPStore binds it seconds later, after the other ranks started; meanwhile the kernel may hand the
    same port to another job on the machine, and one of them fails with EADDRINUSE. This socket stays bound with
    SO_REUSEADDR and never listens: no other socket can bind the port and ``bind(0)`` never returns it, while the
    TCPStore (which sets SO_REUSEADDR too) still binds and listens on it. Under torchrun (its store binds port 0
    itself), SLURM (Lightning derives the port from the job id), several nodes, or a ``MASTER_PORT`` you set,
    nothing is done.
    """

    def __init__(self) -> None:
        self._socket: socket.socket | None = None

    def hold(self, plan: Plan) -> int | None:
        """Binds the port for ``plan``'s run when it needs one; the port, or None when nothing is held."""
        world = plan.launched_world_size or 1
        if plan.launch.launcher != "none" or plan.num_nodes > 1 or world < 2 or plan.launch.master_port:
            return None
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("", 0))
        port = self._socket.getsockname()[1]
        os.environ["MASTER_PORT"] = str(port)  # written for the ranks Lightning's launcher starts (they inherit it)
        return port

    def release(self) -> None:
        """Closes the port :meth:`hold` held and forgets its ``MASTER_PORT`` (the run is over)."""
        if self._socket is not None:
            os.environ.pop("MASTER_PORT", None)  # written: the next run in this process picks its own
            self._socket.close()
            self._socket = None


def join_this_attempt(strategy: Any, launch: Launch) -> None:
    """Under a restartable torchrun job, forms the process group in a namespace of this attempt of the agent's store.

    Why by hand: torchrun's agent serves one TCPStore to the workers for the whole job
    (``TORCHELASTIC_USE_AGENT_STORE``), and torch's ``env://`` rendezvous uses it without a per-attempt prefix (since
    torch 2.5; pytorch/pytorch#135712). After a restart the new workers can read the addresses the dead ones published
    and gloo's ``connectFullMesh`` fails ("Connection refused", or "Connect timeout" after minutes). torch 2.4 put each
    attempt under ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``; this restores that, then forms the group with
    Lightning's own helper (the strategy's backend and timeout), whose later call finds it formed and returns.

    The count is per node agent: on several nodes a node that restarts only because another one rejoined keeps its
    count (torch's limitation, the same issue), so multi-node elastic jobs should set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun, which gives every attempt a store of its own.
    """
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from torch.distributed.constants import default_pg_timeout

    env = getattr(strategy, "cluster_environment", None)
    backend = process_group_backend(strategy)
    if not (launch.max_restarts and isinstance(env, TorchElasticEnvironment) and backend and launch.multi_task):
        return
    if not launch.agent_store or dist.is_initialized():
        return  # a store of this attempt's own (rank 0 hosts it): nothing stale in it
    timeout = strategy_timeout(strategy) or default_pg_timeout
    store = dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"/worker/attempt_{launch.restart_count}", store)
    init_dist_connection(env, backend, store=store, timeout=timeout, **device_id_kwargs(strategy))


def device_id_kwargs(strategy: Any) -> dict[str, Any]:
    """``device_id`` for the process group, as the strategy's own ``setup_distributed`` would bind it: its root
    device, none on CPU, none where the strategy says its process spans several devices (``process_group_device``:
    ddp_mp's stages; bound to the first stage's GPU, NCCL refuses the later stages' tensors)."""
    device = strategy.process_group_device if hasattr(strategy, "process_group_device") else strategy.root_device
    return {"device_id": device} if device is not None and device.type != "cpu" else {}


def apply_timeout(strategy: Any, seconds: float | None) -> None:
    """Sets how long the ranks wait for each other (the process-group timeout, rendezvous included).

    Lightning exposes this only as the ``timeout`` argument of ``DDPStrategy`` and its subclasses, which a strategy
    given by name (``--trainer.strategy ddp``) cannot carry (:func:`app.lightning_private.set_strategy_timeout`).
    """
    if seconds is not None:
        set_strategy_timeout(strategy, timedelta(seconds=seconds))


@contextlib.contextmanager
def rendezvous_errors_explained(plan: Plan | None) -> Iterator[None]:
    """Turns c10d's rendezvous timeouts into a message that says which ranks of ``plan`` are missing and what to
    check; other errors, and any error without a plan, pass unchanged."""
    try:
        yield
    except Exception as err:
        import torch.distributed as dist

        if not isinstance(err, getattr(dist, "DistError", ())) or "imed out" not in str(err) or plan is None:
            raise
        raise RendezvousTimeout(_explain(err, plan)) from None


def _explain(err: Exception, plan: Plan) -> str:
    launch = plan.launch
    world = launch.world_size if launch.launcher != "none" else plan.world_size
    rank = launch.rank if launch.launcher != "none" else launch.node_rank * (plan.devices or 1)
    now = detect()  # Lightning fills in MASTER_ADDR/PORT when the launcher did not
    address = f"{now.master_addr or main_address(launch)}:{now.master_port or launch.master_port or '?'}"
    torch_says = str(err).strip().splitlines()[0][:300]
    joined = re.search(r"(\d+)/(\d+) clients joined", torch_says)
    if rank == 0:
        count = f"only {joined.group(1)} of {joined.group(2)}" if joined else f"not all {world}"
        missing = f"rank 0 waited at {address} for the {world} ranks of the job; {count} arrived"
    else:
        missing = f"rank {rank} never reached rank 0 at {address}: rank 0 did not start, or is unreachable"
    layout = "\n".join(line for line in plan.render().splitlines() if line.startswith("    node"))
    wait = f"{plan.timeout:g} s (--launch.timeout)" if plan.timeout is not None else "the strategy's timeout"
    return (
        f"the ranks did not all meet within {wait}: {missing} (torch: {torch_says}).\n"
        f"Expected layout:\n{layout}\n"
        "Check that every node started its processes (`squeue`/`sacct`, or the torchrun/python command on each "
        "node), that all use the same MASTER_ADDR/MASTER_PORT, and that the port is reachable from every node."
    )
