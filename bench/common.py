"""What the benchmarks share: the 2-process ``torchrun`` job, machine facts, robust statistics, result files."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    """CPU count, accelerator, library versions and date: printed next to every result."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host_cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
    }
    try:  # the installed version, without importing lightning (~10 s here)
        info["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        info["lightning"] = None
    return info


def machine_line(info: dict[str, Any]) -> str:
    gpu = f", {info['gpus']}x {info['gpu']}" if info.get("gpu") else ", no GPU"
    return (
        f"{info['date']}; {info['host_cpus']} CPUs ({info['cpu']}){gpu}; torch {info['torch']}, "
        f"lightning {info.get('lightning')}, Python {info['python']}"
    )


def summary(seconds: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile in milliseconds, and the number of samples."""
    ms = sorted(s * 1e3 for s in seconds)
    if not ms:
        return {"median_ms": float("nan"), "p10_ms": float("nan"), "p90_ms": float("nan"), "n": 0}
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1], "n": len(ms)}


def run_job(
    tasks: list[dict[str, Any]], nproc: int, workdir: Path, timeout: float = 1800, progress: bool = False
) -> dict[str, Any]:
    """Runs ``bench.common`` as an ``nproc``-process torchrun job doing ``tasks`` in turn; returns rank 0's results.

    One job serves several benchmarks (each task names a ``module:function`` worker), so the process start-up and
    imports (~10 s per process here) are paid once. Workers get the initialised default process group.
    ``progress``: the job's standard output (rank 0's progress lines) goes to the terminal instead of being captured.
    """
    from app.launch.torchrun import run_torchrun_job

    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "bench_spec.json", workdir / "bench_results.json"
    spec.write_text(json.dumps({"tasks": tasks, "out": str(out)}))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # torchrun would set it anyway (with a warning)
    return run_torchrun_job("bench.common", [str(spec)], nproc, out, "benchmark", timeout, progress, env)


def _worker(spec_path: str) -> None:
    import importlib

    import torch.distributed as dist

    from app.launch.group import end_process_group

    spec = json.loads(Path(spec_path).read_text())
    cuda = torch.cuda.is_available() and any(t.get("accelerator") == "cuda" for t in spec["tasks"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    results = {}
    for task in spec["tasks"]:
        module, function = task["worker"].split(":")
        results[task["name"]] = getattr(importlib.import_module(module), function)(task)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    end_process_group()


def progress(message: str) -> None:
    """A progress line from rank 0 of the job (shown with ``run_job(progress=True)``)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    _worker(sys.argv[1])
