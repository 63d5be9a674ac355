"""One ``torchrun`` job on this machine: ``python -m MODULE ARGS`` in ``nproc`` processes, started from the repository
root, its result a JSON file rank 0 writes. Used by the parity tool, the benchmarks and the distributed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun_job(
    module: str,
    args: list[str],
    nproc: int,
    results: Path,
    what: str,
    timeout: float = 1800,
    progress: bool = False,
    env: dict[str, str] | None = None,
) -> Any:
    """Runs the job (``--standalone``: torchrun picks a free rendezvous port) and returns what it wrote to ``results``.

    ``progress``: the job's standard output goes to the terminal instead of being captured. ``env`` adds variables.

    Raises:
        RuntimeError: the job failed or wrote no results; ``what`` names it, the message holds the output's tail.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += ["-m", module, *args]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    full_env.update(env or {})
    stdout = None if progress else subprocess.PIPE
    job = subprocess.run(
        command, cwd=ROOT, env=full_env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout
    )
    if job.returncode != 0 or not results.exists():
        output = (job.stdout or "")[-4000:] + "\n" + job.stderr[-8000:]
        raise RuntimeError(f"{what} job failed (exit {job.returncode}):\n{output}")
    return json.loads(results.read_text())
