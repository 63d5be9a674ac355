"""The throwaway SLURM cluster of ``tools/slurm_cluster.sh``; without it every ``slurm`` test skips saying how.

Under ``.ci/run``, which starts the cluster and sets ``DPTRAIN_REQUIRE_SLURM=1``, a cluster that cannot be found (or
has fewer nodes than a test needs) fails the tests instead: CI must not pass by skipping them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONF = "/tmp/dptrain-slurm/slurm.conf"  # where `tools/slurm_cluster.sh start` writes it by default
START = "`bash tools/slurm_cluster.sh install && bash tools/slurm_cluster.sh start` (as root; .ci/run does it)"
REQUIRED = os.environ.get("DPTRAIN_REQUIRE_SLURM") == "1"


def skip_or_fail(reason: str) -> None:
    """Skips, or fails when the cluster is required (CI started it)."""
    if REQUIRED:
        pytest.fail(f"DPTRAIN_REQUIRE_SLURM=1 (set by .ci/run after starting the cluster), but: {reason}")
    pytest.skip(reason)


def _cluster_env() -> dict[str, str] | None:
    conf = os.environ.get("SLURM_CONF", DEFAULT_CONF)
    if not shutil.which("sbatch") or not Path(conf).is_file():
        return None
    # the simulated nodes n1/n2 do not resolve: the rendezvous host is given explicitly (see tools/slurm_cluster.sh)
    env = {**os.environ, "SLURM_CONF": conf, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True, timeout=30)
    return env if sinfo.returncode == 0 and sinfo.stdout.strip() else None


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Environment for sbatch/srun against the running cluster (skips when there is none)."""
    env = _cluster_env()
    if env is None:
        skip_or_fail(f"no SLURM cluster is up (no sbatch, or sinfo fails for SLURM_CONF): start one with {START}")
    return env


@pytest.fixture(scope="session")
def slurm_nodes(slurm_env) -> int:
    out = subprocess.run(["sinfo", "-h", "-o", "%D"], env=slurm_env, capture_output=True, text=True, check=True)
    return sum(int(n) for n in out.stdout.split())


def submit(slurm_env: dict[str, str], *args: str) -> str:
    """``python -m tools.slurm submit ARGS`` as a user runs it; returns the job id.

    The job's rendezvous port is a free one, passed on by sbatch as ``MASTER_PORT``: Lightning's default derives it
    from the job id (15000 + its last 4 digits), the same numbers for every throwaway cluster, which starts at job 1.
    """
    env = {**slurm_env, "MASTER_PORT": str(free_port())}
    out = subprocess.run(
        [sys.executable, "-m", "tools.slurm", "submit", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    match = re.search(r"submitted job (\d+)", out.stdout)
    assert match, out.stdout
    return match.group(1)


def job_info(slurm_env: dict[str, str], job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=slurm_env, capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(slurm_env: dict[str, str], job_id: str, timeout: float = 600) -> dict[str, str]:
    """Waits until the job has left the queue (requeues included); cancels it and fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(slurm_env, job_id)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=slurm_env)
    pytest.fail(f"job {job_id} did not finish within {timeout} s: {job_info(slurm_env, job_id)}")
