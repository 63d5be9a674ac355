"""What the benchmarks share: the 2-process ``torchrun`` job, machine facts, robust statistics, result files
(:func:`report`), figures (:func:`figure`) and the step clock (:func:`batch_clock`)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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


def load_remark(load: list[float], busy: float) -> str:
    """What the load average around a run says: ``busy`` is the load the benchmark itself puts on the machine."""
    if max(load) > busy + 1:
        return "other jobs shared the machine: absolute figures are low, compare the ratios measured in the same run"
    return "no other job was running"


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
    from tools.torchrun import run_torchrun_job

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


def batch_clock(
    device: torch.device | str,
    starts_at: Callable[[int], bool] = lambda batch_idx: True,
    ends_at: Callable[[int], bool] = lambda batch_idx: False,
    on_epoch_end: Callable[[Any, int], Any] | None = None,
) -> Any:
    """The benchmarks' one timing callback: synchronised ``time.perf_counter()`` readings in ``starts`` when a
    training batch whose index passes ``starts_at`` begins (after it was fetched) and in ``ends`` when one passing
    ``ends_at`` ends; ``images`` counts the images trained on, and ``on_epoch_end(module, images)`` runs after
    each training epoch (its validation and checkpoint included). On CUDA each reading waits for the device."""
    from lightning.pytorch import Callback

    cuda = torch.device(device).type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    class BatchClock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.images = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if starts_at(batch_idx):
                self.starts.append(now())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.images += len(batch[1])
            if ends_at(batch_idx):
                self.ends.append(now())

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if on_epoch_end is not None:
                on_epoch_end(pl_module, self.images)

    return BatchClock()


@contextlib.contextmanager
def figure(path: Path, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure (``plt.subplots(**subplots)``, no display needed) saved to ``path`` when the block ends."""
    from tools.dev_extras import use_dev_extras

    use_dev_extras()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def report(
    stem: Path,
    settings: dict[str, Any],
    load: list[float],
    figures: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any]], Any],
) -> dict[str, Any]:
    """A benchmark's results (machine, load, settings, then its figures): writes ``stem.json`` and ``stem.md``, then
    calls ``plot(results)``; returns the results."""
    results = {"machine": machine(), "load": load, "settings": settings, **figures}
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_json(stem.with_suffix(".json"), results)
    stem.with_suffix(".md").write_text(markdown(results) + "\n")
    plot(results)
    return results


def save(
    out: Path,
    name: str,
    result: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Any] | None = None,
) -> None:
    """Writes ``out/name.json`` and ``out/name.md`` (and ``out/name.png`` with ``plot(result, path)``), then prints the
    markdown."""
    text = markdown(result)
    write_json(out / f"{name}.json", result)
    (out / f"{name}.md").write_text(text)
    if plot is not None:
        plot(result, out / f"{name}.png")
    print(text)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    _worker(sys.argv[1])
