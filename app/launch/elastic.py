"""``--launch.max_restarts K``: a one-node multi-process ``fit`` that Lightning's launcher would start is handed to
torch's elastic agent, which restarts the worker group up to K times when a rank fails.

Why ``torch.distributed.launcher.api.elastic_launch``: it is torch's engine, the one behind ``torchrun
--max-restarts``, so the workers see torchrun's variables (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``), :func:`core.env.detect` reports them as torchrun, and what the app does for a torchrun
job applies unchanged: a restarted group resumes from the newest ``last.ckpt`` of its job
(:meth:`app.checkpoint.Checkpoints.decide`, keyed on the run id given here) and ends bit for bit as an uninterrupted
run; the survivors' lost-rank line says a restart follows; each attempt meets in its own namespace of the agent's
store (:func:`app.launch.rendezvous.join_this_attempt`), which the hang watch reads too. No supervisor of our own.

What a user gives up against Lightning's launcher: one more process (this one parses the command, then only waits;
under Lightning's launcher it would be rank 0), and every restart repeats the start-up (imports, data set-up). What
they gain: a rank that dies (SIGKILL, the OOM killer, a killed DataLoader worker) or that the hang watch finds stuck
restarts the group instead of ending the job, which loses at most the steps since the last ``last.ckpt``
(``--checkpoint.interval_minutes``, 10 by default).
"""

from __future__ import annotations

import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from app.launch.plan import Plan
from app.resilience.requeue import RestartsUsedUp

MONITOR_INTERVAL_S = 0.5  # how often the agent looks at its workers (torchrun: 0.1 s; a dead rank is seen in time)


def run_by_agent(plan: Plan, port: int | str | None) -> None:
    """Runs this command's job under torch's elastic agent when ``plan.by_agent``, and ends the process; returns at
    once otherwise.

    The workers run the same command line (``sys.orig_argv``: interpreter options, ``cli.py`` and its arguments)
    and meet at the agent's store on ``port`` of this host (the port :class:`app.launch.rendezvous.HeldPort` holds,
    or your ``MASTER_PORT``). Exit status 0 when the group finished; 1 with one ``error:`` line naming the failed rank
    when the restarts are used up; 128 + N when signal N stopped this process (the agent stops the workers first).
    """
    if not plan.by_agent:
        return
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.world_size or 1,
        run_id=uuid.uuid4().hex,  # keys the run's checkpoints: a restart resumes only this job's
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"is_host": True},  # this process hosts the store: never a client of another job on the port
        max_restarts=plan.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
    )
    try:
        elastic_launch(config, sys.executable)(*sys.orig_argv[1:])
    except ChildFailedError as err:
        raise used_up(err, plan.max_restarts) from None
    except SignalException as err:  # Ctrl-C, SIGTERM: the agent has stopped the workers (they save last.ckpt)
        raise SystemExit(128 + int(err.sigval)) from None
    raise SystemExit(0)


def used_up(err: ChildFailedError, restarts: int) -> RestartsUsedUp:
    """The error of a job whose restarts are used up: the first rank that failed, and how."""
    rank, failure = err.get_first_failure()
    code = failure.exitcode
    how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with status {code}"
    if code == -signal.SIGKILL:
        how += " (the OOM killer, or a kill -9)"
    return RestartsUsedUp(
        f"rank {rank} (pid {failure.pid}) {how}, and torch's elastic agent has no restart left ({restarts} of "
        f"{restarts} used), so the job fails; the ranks' own lines above say more. Fix: look at that rank's log, then "
        "resume with the same command plus `--ckpt_path last`."
    )
