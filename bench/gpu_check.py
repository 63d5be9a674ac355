"""The one prepared GPU check: ``make gpu-check`` (``python -m bench.gpu_check``), one GPU, under 8 minutes.

Runs, each step time-boxed, a failing step recorded while the rest still run:

- a short fit of the ImageNet config (synthetic data, resnet18) in every mode one GPU allows: single device, ``dp`` on
  1 GPU, ``ddp`` and ``allreduce`` on NCCL at world size 1, ``ddp_mp`` with 1 device per process; then ``ddp`` and
  ``allreduce`` with 2 processes sharing the GPU over gloo (two simulated nodes of one GPU each: NCCL refuses two
  ranks on one GPU); each precision (32-true with TF32, 16-mixed with a GradScaler, bf16-mixed, 16-true, bf16-true),
  channels_last, compile, and a resume from ``last.ckpt``;
- the no-sync check: training steps of the default config under ``torch.cuda.set_sync_debug_mode("error")``, logging
  steps allowed;
- ``tests/gpu`` (what one GPU allows), ``bench.gpu`` (ResNet-50 img/s and MFU per precision, app step / plain PyTorch
  step), and the real training loader with 16 workers on generated JPEGs against the GPU's synthetic img/s.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``$GPU_CHECK_OUT`` (default ``bench/results/``). With
``GPU_CHECK_CPU=1`` the same steps run on the CPU at tiny sizes (what needs CUDA is skipped, saying why), writing
into ``runs/gpu_check_cpu/`` unless ``GPU_CHECK_OUT`` is set: CPU results never land where GPU results belong.
Exit status 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, machine_line, write_json

CPU = os.environ.get("GPU_CHECK_CPU") == "1"


def sizes() -> dict[str, Any]:
    """Per-step sizes: a few real steps on the GPU, the smallest that exercises the code on the CPU."""
    if CPU:
        return {
            "batch": 2,
            "px": 16,
            "steps": 2,
            "workers": 0,
            "timeout": 120,
            "loader_images": 32,
            "loader_workers": 2,
        }
    return {
        "batch": 64,
        "px": 128,
        "steps": 20,
        "workers": 4,
        "timeout": 90,
        "loader_images": 3000,
        "loader_workers": 16,
    }


def fit_args(workdir: Path, name: str, extra: list[str]) -> list[str]:
    """``cli.py fit`` arguments: the ImageNet config on synthetic data, resnet18, one epoch of ``steps`` steps."""
    z = sizes()
    return [
        "fit", "--config", str(ROOT / "configs" / "imagenet.yaml"), "--model.arch", "resnet18",
        "--data.synthetic", "true", "--data.synthetic_train_size", str(z["batch"] * z["steps"]),
        "--data.synthetic_val_size", str(z["batch"]), "--data.batch_size", str(z["batch"]),
        "--data.image_size", str(z["px"]), "--data.num_workers", str(z["workers"]), "--trainer.max_epochs", "1",
        "--trainer.accelerator", "cpu" if CPU else "cuda", "--trainer.devices", "1",
        "--trainer.default_root_dir", str(workdir / name.replace(" ", "_")), "--trainer.enable_progress_bar", "false",
        *extra,
    ]  # fmt: skip


# name, extra cli.py arguments, why it cannot run on a CPU (None: it can)
FITS: list[tuple[str, list[str], str | None]] = [
    ("mode single device", ["--trainer.strategy", "auto"], None),
    ("mode dp (1 GPU)", ["--trainer.strategy", "dp"], None),
    ("mode ddp (NCCL, world 1)", ["--trainer.strategy", "ddp"], None),
    ("mode allreduce (NCCL, world 1)", ["--trainer.strategy", "allreduce"], None),
    (
        "mode ddp_mp (1 device per process)",
        [
            "--config",
            str(ROOT / "configs/strategy/ddp_mp.yaml"),
            "--trainer.strategy.init_args.devices_per_process",
            "1",
        ],
        None,
    ),
    ("precision 32-true (TF32)", ["--trainer.precision", "32-true"], None),
    ("precision 16-mixed (GradScaler)", ["--trainer.precision", "16-mixed"], "fp16 AMP needs CUDA (refused on CPU)"),
    ("precision bf16-mixed", ["--trainer.precision", "bf16-mixed"], None),
    (
        "precision 16-true",
        ["--trainer.precision", "16-true"],
        "fp16 convolutions are slow on a CPU; bf16-true runs the same code",
    ),
    ("precision bf16-true", ["--trainer.precision", "bf16-true"], None),
    ("channels_last", ["--model.channels_last", "true"], None),
    ("compile", ["--model.compile", "true"], "torch.compile on a CPU needs a C++ toolchain and minutes"),
]
TWO_NODES = [  # 2 processes on the one GPU: gloo with CUDA tensors
    ("mode ddp (2 processes, gloo)", ["--config", str(ROOT / "configs/strategy/ddp.yaml")]),
    ("mode allreduce (2 processes, gloo)", ["--config", str(ROOT / "configs/strategy/allreduce.yaml")]),
]


def _facts(trainer: Any) -> dict[str, Any]:
    import torch

    metrics = trainer.callback_metrics
    facts: dict[str, Any] = {"global_step": trainer.global_step, "precision": trainer.precision}
    for key in ("train/loss", "val/acc1", "perf/images_per_sec", "amp/loss_scale"):
        if key in metrics:
            facts[key] = round(float(metrics[key]), 4)
    facts["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    facts["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return facts


class _Timeout(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Timeout()


def run_group(spec_path: str) -> None:
    """One process running several fits in turn (imports paid once), each time-boxed with SIGALRM; one JSON line per
    item is appended to the results file as soon as it ends, so a crash of the process loses only what is left."""
    from app.cli import main

    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGALRM, _alarm)
    for item in spec["items"]:
        began, record = time.perf_counter(), {"name": item["name"]}
        signal.alarm(int(item["timeout"]))
        try:
            cli = None
            for args in item["runs"]:  # a resume is two runs
                cli = main(args)
            record |= {"status": "passed", "facts": _facts(cli.trainer)}
            if item.get("expect_step") and cli.trainer.global_step != item["expect_step"]:
                record |= {"status": "failed", "error": f"global_step {cli.trainer.global_step}, "
                           f"expected {item['expect_step']}"}  # fmt: skip
        except _Timeout:
            record |= {"status": "timeout", "error": f"still running after {item['timeout']} s"}
        except BaseException as err:  # noqa: BLE001 (SystemExit from the CLI included: record, go on)
            record |= {"status": "failed", "error": f"{type(err).__name__}: {err}"[-3000:]}
        finally:
            signal.alarm(0)
        record["seconds"] = round(time.perf_counter() - began, 1)
        with open(spec["results"], "a") as f:
            f.write(json.dumps(record) + "\n")


def _group(items: list[dict], workdir: Path, tag: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    spec = {"items": items, "results": str(workdir / f"{tag}.jsonl")}
    (workdir / f"{tag}.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "bench.gpu_check", "--group", str(workdir / f"{tag}.json")]
    log = open(workdir / f"{tag}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=log)


def _collect(items: list[dict], workdir: Path, tags: list[str], procs: list[subprocess.Popen]) -> list[dict]:
    budget = sum(i["timeout"] for i in items) + 60
    for proc in procs:
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = []
    for item in items:
        records = []
        for tag in tags:
            path = workdir / f"{tag}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            found = [json.loads(line) for line in lines if json.loads(line)["name"] == item["name"]]
            log = (workdir / f"{tag}.log").read_text()[-1500:]
            records.append(found[0] if found else {"status": "failed", "error": f"not run: the group process "
                           f"ended before it (exit {procs[tags.index(tag)].returncode}); log: {log}"})  # fmt: skip
        worst = next((r for r in records if r["status"] != "passed"), records[0])
        out.append({"step": item["name"], **{k: v for k, v in worst.items() if k != "name"}})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fits(workdir: Path) -> list[dict]:
    z, rows, items = sizes(), [], []
    for name, extra, cpu_reason in FITS:
        name = name.replace("NCCL", "gloo").replace("1 GPU", "1 CPU device") if CPU else name
        if CPU and cpu_reason:
            rows.append({"step": name, "status": "skipped", "error": cpu_reason})
            continue
        items.append({"name": name, "runs": [fit_args(workdir, name, extra)], "timeout": z["timeout"],
                      "expect_step": z["steps"]})  # fmt: skip
    resume = fit_args(workdir, "resume", [])
    items.append({"name": "resume from last.ckpt", "timeout": 2 * z["timeout"], "expect_step": 2 * z["steps"],
                  "runs": [resume, [*resume, "--trainer.max_epochs", "2", "--ckpt_path", "last"]]})  # fmt: skip
    rows += _collect(items, workdir, ["fits"], [_group(items, workdir, "fits")])
    # two simulated nodes of one device each (Lightning's LightningEnvironment: NODE_RANK, MASTER_ADDR/PORT)
    pair = []
    for name, extra in TWO_NODES:
        args = fit_args(workdir, name, [*extra, "--trainer.num_nodes", "2"])
        args += ["--trainer.strategy.init_args.process_group_backend", "gloo"]
        pair.append({"name": name, "runs": [args], "timeout": z["timeout"], "expect_step": z["steps"] // 2})
    port = str(_free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [_group(pair, workdir, f"nodes{r}", {**env, "NODE_RANK": str(r)}) for r in (0, 1)]
    return rows + _collect(pair, workdir, ["nodes0", "nodes1"], procs)


def _subprocess_step(name: str, command: list[str], timeout: float, env: dict | None = None) -> dict[str, Any]:
    began = time.perf_counter()
    try:
        job = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                             timeout=timeout)  # fmt: skip
        status = "passed" if job.returncode == 0 else "failed"
        tail = (job.stdout + job.stderr)[-2500:]
    except subprocess.TimeoutExpired as err:
        status, tail = "timeout", f"still running after {timeout} s: {str(err.stdout or '')[-1500:]}"
    row = {"step": name, "status": status, "seconds": round(time.perf_counter() - began, 1)}
    return row | ({"output": tail} if status == "passed" else {"error": tail})


NOSYNC = '''
import sys, torch
from lightning.pytorch import Callback
from app.cli import main
from app.logging_steps import is_logging_step

class SyncGuard(Callback):
    """Errors on any synchronising CUDA call from the start of a non-logging training step to the next step's start
    (the step, the optimizer, the callbacks and the progress bar, fetching the next batch); logging steps may read."""
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        logging = is_logging_step(trainer)
        torch.cuda.set_sync_debug_mode("error" if batch_idx >= 3 and not logging else 0)
        self.checked = getattr(self, "checked", 0) + (batch_idx >= 3 and not logging)
    def on_train_epoch_end(self, *args): torch.cuda.set_sync_debug_mode(0)
    def on_validation_start(self, *args): torch.cuda.set_sync_debug_mode(0)
    def on_train_end(self, *args): torch.cuda.set_sync_debug_mode(0)

cli = main(sys.argv[1:], run=False)
guard = SyncGuard()
cli.trainer.callbacks.append(guard)
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
print(f"no synchronising CUDA call in {guard.checked} non-logging training steps")
sys.exit(0 if guard.checked else "no training step was checked: too few steps")
'''


def nosync(workdir: Path) -> dict[str, Any]:
    if CPU:
        return {"step": "no host sync in training steps", "status": "skipped", "error": "needs CUDA"}
    mnist = (ROOT / "data" / "MNIST" / "raw").is_dir()
    # the default config (MNIST) when its data was copied along (no network on the GPU machine), else ImageNet's
    args = ["--trainer.max_steps", "60", "--trainer.limit_val_batches", "0", "--trainer.accelerator", "cuda",
            "--trainer.default_root_dir", str(workdir / "nosync")]  # fmt: skip
    if not mnist:
        args = fit_args(workdir, "nosync", ["--trainer.max_steps", "60", "--trainer.limit_val_batches", "0"])[1:]
    script = workdir / "nosync.py"
    script.write_text(NOSYNC)
    row = _subprocess_step("no host sync in training steps", [sys.executable, str(script), *args], 180,
                           {"PYTHONPATH": str(ROOT)})  # fmt: skip
    row["config"] = "default (MNIST)" if mnist else "ImageNet synthetic (MNIST not in data/)"
    return row


def bench_and_loader(out: Path) -> list[dict]:
    z = sizes()
    gpu_args = ["--smoke", "--configs", "bf16 channels_last"] if CPU else ["--skip-mnist", "--budget-s", "120"]
    rows = [_subprocess_step("bench.gpu", [sys.executable, "-m", "bench.gpu", *gpu_args, "--out", str(out)],
                             120 if CPU else 300)]  # fmt: skip
    loader = [sys.executable, "-m", "bench.loader", "--dataloader-workers", str(z["loader_workers"]), "--images",
              str(z["loader_images"]), "--batch-size", str(8 if CPU else 256), "--out", str(out)]  # fmt: skip
    photos = ROOT / ".gpu-wheels" / "photos"  # the GPU image has no scikit-image, scikit-learn, matplotlib
    env = {"BENCH_PHOTOS": str(photos)} if photos.is_dir() else None
    rows.append(_subprocess_step(f"training loader, {z['loader_workers']} workers", loader, 120 if CPU else 240, env))
    fed = None
    try:  # is the GPU starved? the loader's img/s against the GPU's synthetic img/s (bf16 channels_last)
        fed = json.loads((out / "loader_dataloader.json").read_text())["img_per_s"]
        benches = [p for p in out.glob("gpu_*.json") if not p.name.startswith("gpu_check")]
        bench = max(benches, key=lambda p: p.stat().st_mtime)
        gpu = next(
            r["img_per_s"] for r in json.loads(bench.read_text())["throughput"] if r["config"].startswith("bf16")
        )
        rows[-1]["facts"] = {"loader_img_per_s": fed, "gpu_synthetic_img_per_s": round(gpu, 1), "starved": fed < gpu}
    except (OSError, ValueError, StopIteration, KeyError) as err:
        rows[-1].setdefault("facts", {"starved": f"unknown ({type(err).__name__})"})
    if not CPU:  # --data.decode gpu: nvJPEG (TorchCodec on CUDA) against the CPU workers above
        gpu_loader = [*loader, "--decode", "gpu"]
        rows.append(
            _subprocess_step(f"training loader, decode gpu, {z['loader_workers']} workers", gpu_loader, 240, env)
        )
        try:
            fed_gpu = json.loads((out / "loader_dataloader_gpu.json").read_text())["img_per_s"]
            rows[-1]["facts"] = {"loader_img_per_s": fed_gpu, "cpu_decode_img_per_s": fed}
        except (OSError, ValueError, KeyError) as err:
            rows[-1].setdefault("facts", {"loader_img_per_s": f"unknown ({type(err).__name__})"})
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# GPU check{' (CPU MODE: tiny sizes, not a GPU result)' if results['cpu_mode'] else ''}",
        "",
        f"Machine: {machine_line(results['machine'])}. Command: `{results['command']}`. "
        f"Total {results['seconds']:.0f} s; {results['failed']} step(s) failed.",
        "",
        "| step | status | s | facts / error |",
        "|---|---|---|---|",
    ]
    for row in results["steps"]:
        detail = json.dumps(row.get("facts")) if row.get("facts") else (row.get("error") or "")
        detail = " ".join(str(detail).split())[-400:].replace("|", "/")
        lines.append(f"| {row['step']} | {row['status']} | {row.get('seconds', '')} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=None, help="comma-separated parts: fits,nosync,tests,bench (default all)")
    args = parser.parse_args(argv)
    if args.group:
        run_group(args.group)
        return 0
    import torch

    if not CPU and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU machine, or GPU_CHECK_CPU=1 for the CPU code check")
    default_out = ROOT / "runs" / "gpu_check_cpu" if CPU else RESULTS
    out = Path(os.environ.get("GPU_CHECK_OUT") or default_out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = set((args.only or "fits,nosync,tests,bench").split(","))
    began, steps = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        if "fits" in parts:
            steps += fits(workdir)
        if "nosync" in parts:
            steps.append(nosync(workdir))
        if "tests" in parts:
            pytest = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"]
            steps.append(_subprocess_step("tests/gpu", pytest, 120 if CPU else 240))
        if "bench" in parts:
            steps += bench_and_loader(out)
    failed = sum(s["status"] in ("failed", "timeout") for s in steps)
    results = {
        "machine": machine(),
        "cpu_mode": CPU,
        "command": ("GPU_CHECK_CPU=1 " if CPU else "") + "make gpu-check",
        "seconds": round(time.perf_counter() - began, 1),
        "failed": failed,
        "steps": steps,
    }
    write_json(out / "gpu_check.json", results)
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out / 'gpu_check.json'} and gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
