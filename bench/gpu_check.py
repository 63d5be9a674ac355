"""The prepared GPU check: ``make gpu-check CALL=A`` then ``CALL=B`` (``python -m bench.gpu_check --call A|B``).

Two calls, each under ``CALL_LIMIT_S`` (540 s) of wall time with the offline install, because the GPU machine runs one
command for at most 600 s and brings back only what it wrote. Each step is time-boxed (``CALLS``: the boxes and the
install add up to less than the limit, checked before anything runs), and a failing step is recorded while the rest
still run:

- call A: short fits of the ImageNet config (synthetic data, resnet18) in every mode one GPU allows, each labelled
  with what it proves, and whether the world-1 modes (same seed, same data) end at the same loss; ``ddp`` and
  ``allreduce`` with 2 processes sharing the GPU over gloo (a real all-reduce of CUDA tensors); each precision,
  channels_last, a resume from ``last.ckpt`` (the only fit that saves checkpoints); the no-sync check (training steps
  of the default config under ``torch.cuda.set_sync_debug_mode("error")``, logging steps allowed); ``tests/gpu``.
- call B: ``bench.imagenet_e2e`` (the ImageNet recipe trained from JPEG files with each decoder, classic and with the
  modern recipe's augmentations, beside the same process's synthetic compiled rate, the data wait, a restart that
  reuses the compile cache, and what ``--trainer.deterministic true`` costs), then ``bench.gpu`` (ResNet-50 img/s
  and MFU per precision).

Each call writes as it goes into ``$GPU_CHECK_OUT`` (default ``bench/results/``): one JSON line per finished step in
``gpu_check_<call>.jsonl`` and ``gpu_check_<call>.md`` rebuilt from it after each step, so a call cut short returns
everything that finished; at most ``MAX_FILES`` (6) files per call. With ``GPU_CHECK_CPU=1`` the same steps run on the
CPU at tiny sizes (what needs CUDA is skipped, saying why), into ``runs/gpu_check_cpu/`` unless ``GPU_CHECK_OUT`` is
set, and a rehearsal step kills a call part-way and checks what it left. Exit status 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from app.strategies.modes import declared_modes
from bench.common import RESULTS, ROOT, machine, machine_line
from core.layout import layout_of

CPU = os.environ.get("GPU_CHECK_CPU") == "1"
CALL_LIMIT_S = 540  # the device runs a command for 600 s at most: 60 s left for its start and the transfers
INSTALL_BOX_S = 40  # `make gpu-check`'s offline install (pip --no-index, 4 small packages), `timeout` in the Makefile
STARTUP_S = 15  # a group process's imports (torch, lightning, the app) before its first fit
MAX_FILES = 6  # per call: the device brings back 8 files at most


def sizes() -> dict[str, Any]:
    """Per-step sizes: a few real steps on the GPU, the smallest that exercises the code on the CPU."""
    if CPU:
        return {"batch": 2, "px": 16, "steps": 2, "workers": 0, "loader_images": 16, "loader_batches": 12,
                "loader_workers": 2, "loader_batch": 4}  # fmt: skip
    return {"batch": 64, "px": 128, "steps": 20, "workers": 4, "loader_images": 512, "loader_batches": 120,
            "loader_workers": 16, "loader_batch": 256}  # fmt: skip


def box(gpu_s: float) -> float:
    """A step's time box: the GPU's (what the call's arithmetic adds up), or a CPU allowance (tiny sizes, 2 busy
    cores: slower than a GPU at its real sizes, and no device limit to fit)."""
    return max(4 * gpu_s, 120) if CPU else gpu_s


def fit_args(workdir: Path, name: str, extra: list[str]) -> list[str]:
    """``cli.py fit`` arguments: the ImageNet config on synthetic data, resnet18, one epoch of ``steps`` steps; its
    GPU defaults pinned off (32-true, NCHW, eager: each fit checks one thing, and none waits for a compile), the
    step's ``extra`` turning one on."""
    z = sizes()
    return [
        "fit", "--config", str(ROOT / "configs" / "imagenet.yaml"), "--model.arch", "resnet18",
        "--trainer.precision", "32-true", "--model.channels_last", "false", "--model.compile", "false",
        "--data.synthetic", "true", "--data.synthetic_train_size", str(z["batch"] * z["steps"]),
        "--data.synthetic_val_size", str(z["batch"]), "--data.batch_size", str(z["batch"]),
        "--data.image_size", str(z["px"]), "--data.num_workers", str(z["workers"]), "--trainer.max_epochs", "1",
        "--trainer.accelerator", "cpu" if CPU else "cuda", "--trainer.devices", "1",
        "--trainer.default_root_dir", str(workdir / name.replace(" ", "_")), "--trainer.enable_progress_bar", "false",
        *extra,
    ]  # fmt: skip


# name, extra cli.py arguments, GPU time box (s), what it proves, why it cannot run on a CPU (None: it can)
WORLD1 = "the strategy's wiring on one CUDA device; no multi-device code (scatter/gather, stage hand-off, all-reduce)"
Fit = tuple[str, list[str], float, str, str | None]


def mode_fits() -> list[Fit]:
    """One fit per strategy class the registry declares (``declared_modes(variants=False)``), each on one device,
    after the single-device baseline: a new mode is checked here without an edit. A mode whose processes need GPUs
    of their own (``ddp_mp``) runs with one device per process."""
    import app.strategies  # noqa: F401  (registers the app's strategy names)

    fits: list[Fit] = [
        ("mode single device", ["--trainer.strategy", "auto"], 35, "the baseline: TF32 on, cudnn.benchmark", None)
    ]
    for name in declared_modes(variants=False):
        layout = layout_of(name, 1)
        if layout.one_process:
            fits.append((f"mode {name} (1 GPU)", ["--trainer.strategy", name], 18, WORLD1, None))
        elif layout.needs_process_gpus:
            cls = StrategyRegistry[name]["strategy"]  # a class takes arguments, a registered name does not
            one = [f"--trainer.strategy={cls.__module__}.{cls.__qualname__}"]
            one += ["--trainer.strategy.init_args.devices_per_process", "1"]
            fits.append((f"mode {name} (1 device per process)", one, 18, WORLD1, None))
        else:
            fits.append(
                (f"mode {name} (NCCL, world 1)", ["--trainer.strategy", name], 18, f"NCCL starts; {WORLD1}", None)
            )
    return fits


FITS: list[Fit] = [
    *mode_fits(),
    (
        "precision 16-mixed (GradScaler)",
        ["--trainer.precision", "16-mixed"],
        18,
        "fp16 autocast + GradScaler on CUDA",
        "fp16 AMP needs CUDA (refused on CPU)",
    ),  # fmt: skip
    ("precision bf16-mixed", ["--trainer.precision", "bf16-mixed"], 18, "bf16 autocast on CUDA", None),
    (
        "precision 16-true",
        ["--trainer.precision", "16-true"],
        18,
        "fp16 weights, SGD; fp32 metric sums",
        "fp16 convolutions are slow on a CPU; bf16-true runs the same code",
    ),  # fmt: skip
    ("precision bf16-true", ["--trainer.precision", "bf16-true"], 18, "bf16 weights; fp32 metric sums", None),
    ("channels_last", ["--model.channels_last", "true"], 18, "NHWC weights and inputs on cuDNN", None),
]
RESUME_BOX_S = 40  # two runs, the first saving last.ckpt


def two_process_fits() -> list[tuple[str, list[str]]]:
    """2 processes on the one GPU (gloo with CUDA tensors): every declared strategy class with one device per process
    (not ``dp``'s one process, not ``ddp_mp``'s GPUs per process), given as its class so that it takes the backend."""
    fits = []
    for name in declared_modes(variants=False):
        layout, cls = layout_of(name, 1), StrategyRegistry[name]["strategy"]
        if not (layout.one_process or layout.needs_process_gpus):
            fits.append(
                (f"mode {name} (2 processes, gloo)", [f"--trainer.strategy={cls.__module__}.{cls.__qualname__}"])
            )
    return fits


TWO_NODES = two_process_fits()
PAIR_BOX_S = 25  # per fit of the pair


def _facts(trainer: Any) -> dict[str, Any]:
    import torch

    metrics = trainer.callback_metrics
    facts: dict[str, Any] = {"global_step": trainer.global_step, "precision": trainer.precision}
    for key in ("train/loss", "val/loss", "val/acc1", "perf/images_per_sec", "amp/loss_scale"):
        if key in metrics:
            value = float(metrics[key])
            facts[key] = round(value, 4) if math.isfinite(value) else str(value)  # (NaN is not JSON)
    facts["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    facts["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return facts


class _Timeout(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Timeout()


def _cli_saving_nothing() -> type:
    """The app's CLI with its ModelCheckpoint saving nothing: each resnet18 checkpoint is ~94 MB written with fsync,
    twice per fit. (``--trainer.enable_checkpointing false`` is refused while the config lists a ModelCheckpoint.)"""
    from app.command import CLI

    class SavingNothing(CLI):
        def before_fit(self) -> None:
            for callback in self.trainer.checkpoint_callbacks:
                callback.save_top_k, callback.save_last = 0, False

    return SavingNothing


def run_group(spec_path: str) -> None:
    """One process running several fits in turn (imports paid once), each time-boxed with SIGALRM; each item's row
    is appended to ``spec["results"]`` as soon as it ends (and the call's markdown rebuilt when it is the call's
    file), so a process killed part-way loses only what was left. Only items with ``checkpoints`` save any."""
    from app.command import main

    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGALRM, _alarm)
    for item in spec["items"]:
        began, record = time.perf_counter(), {"step": item["name"], "proves": item.get("proves")}
        signal.alarm(max(1, round(item["timeout"])))
        try:
            cli = None
            for args in item["runs"]:  # a resume is two runs
                cli = main(args, cli_class=None if item.get("checkpoints") else _cli_saving_nothing())
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
        append_row(Path(spec["results"]), record)


def _group(items: list[dict], results: Path, workdir: Path, tag: str, env: dict | None = None) -> subprocess.Popen:
    (workdir / f"{tag}.json").write_text(json.dumps({"items": items, "results": str(results)}))
    command = [sys.executable, "-m", "bench.gpu_check", "--group", str(workdir / f"{tag}.json")]
    log = open(workdir / f"{tag}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, cwd=ROOT, env=step_env(env), stdout=log, stderr=log)


def _wait(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _missing(items: list[dict], results: Path, workdir: Path, tag: str, proc: subprocess.Popen) -> list[dict]:
    """Rows for the items a group process never finished (it crashed, or its box ran out)."""
    done = {r["step"] for r in read_rows(results)}
    log = (workdir / f"{tag}.log").read_text()[-1500:]
    return [{"step": i["name"], "proves": i.get("proves"), "status": "failed", "error": f"not run: the group "
             f"process ended before it (exit {proc.returncode}); log: {log}"}  # fmt: skip
            for i in items if i["name"] not in done]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_name(name: str) -> str:
    return name.replace("NCCL", "gloo").replace("1 GPU", "1 CPU device") if CPU else name


def fits(ctx: Context) -> list[dict]:
    """The fits of call A in one group process (rows appended as each ends), then whether the world-1 modes agree."""
    z, items = sizes(), []
    for name, extra, seconds, proves, cpu_reason in FITS:
        if CPU and cpu_reason:
            ctx.add({"step": _cpu_name(name), "status": "skipped", "error": cpu_reason})
            continue
        items.append({"name": _cpu_name(name), "runs": [fit_args(ctx.workdir, name, extra)], "timeout": box(seconds),
                      "expect_step": z["steps"], "proves": _cpu_name(proves)})  # fmt: skip
    resume = fit_args(ctx.workdir, "resume", [])
    items.append({"name": "resume from last.ckpt", "checkpoints": True, "timeout": box(RESUME_BOX_S),
                  "expect_step": 2 * z["steps"],
                  "runs": [resume, [*resume, "--trainer.max_epochs", "2", "--ckpt_path", "last"]],
                  "proves": "last.ckpt written and resumed on CUDA"})  # fmt: skip
    proc = _group(items, ctx.rows_path, ctx.workdir, "fits")
    _wait([proc], sum(i["timeout"] for i in items) + STARTUP_S)
    for row in _missing(items, ctx.rows_path, ctx.workdir, "fits", proc):
        ctx.add(row)
    return [world1_agreement(read_rows(ctx.rows_path))]


def same_batches(mode: str) -> str:
    """The world-1 modes that draw the same batches: one process with the loader's RandomSampler, or Lightning's
    DistributedSampler at world size 1 (another shuffle of the same seed): equal losses within each group."""
    return "RandomSampler" if mode == "single device" or layout_of(mode, 1).one_process else "DistributedSampler"


def world1_agreement(rows: list[dict]) -> dict[str, Any]:
    """The world-1 modes share seed, data and precision: within a group drawing the same batches their last logged
    training loss should be equal (cuDNN's autotuned kernels may round differently: within 2%)."""
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        mode = r["step"].removeprefix("mode ").split(" (")[0]
        loss = (r.get("facts") or {}).get("train/loss")
        if r["step"].startswith("mode ") and "2 processes" not in r["step"] and loss is not None:
            groups.setdefault(same_batches(mode), {})[r["step"]] = loss
    row: dict[str, Any] = {"step": "world-1 modes end at the same loss", "facts": groups, "seconds": 0.0,
                           "proves": "the strategies change nothing of the arithmetic at world size 1"}  # fmt: skip
    spreads = {
        group: (max(losses.values()) - min(losses.values())) / max(1e-12, abs(min(losses.values())))
        for group, losses in groups.items()
        if len(losses) > 1
    }
    if not spreads:
        return row | {"status": "failed", "error": f"no two world-1 fits of one group passed: {groups}"}
    row["facts"] = {**groups, "relative_spread": {g: round(v, 5) for g, v in spreads.items()}}
    return row | {"status": "passed" if max(spreads.values()) <= 0.02 else "failed"}


def two_processes(ctx: Context) -> list[dict]:
    """ddp and allreduce with 2 processes sharing the one device (two simulated nodes; NCCL refuses two ranks on
    one GPU): a real all-reduce of CUDA tensors over gloo. Rows from both processes are merged, the worst kept."""
    z, pair = sizes(), []
    for name, extra in TWO_NODES:
        args = fit_args(ctx.workdir, name, [*extra, "--trainer.num_nodes", "2"])
        args += ["--trainer.strategy.init_args.process_group_backend", "gloo"]
        pair.append(
            {
                "name": name,
                "runs": [args],
                "timeout": box(PAIR_BOX_S),
                "expect_step": z["steps"] // 2,
                "proves": "a real all-reduce of CUDA tensors between 2 processes (gloo), DistributedSampler",
            }
        )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    paths = [ctx.workdir / f"nodes{r}.jsonl" for r in (0, 1)]
    procs = [_group(pair, paths[r], ctx.workdir, f"nodes{r}", {**env, "NODE_RANK": str(r)}) for r in (0, 1)]
    _wait(procs, sum(i["timeout"] for i in pair) + STARTUP_S)
    rows = []
    for item in pair:
        found = []
        for r in (0, 1):
            mine = [row for row in read_rows(paths[r]) if row["step"] == item["name"]]
            found += mine or _missing([item], paths[r], ctx.workdir, f"nodes{r}", procs[r])
        rows.append(next((row for row in found if row["status"] != "passed"), found[0]))
    return rows


def step_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a step's subprocess: this one's with ``extra`` over it, a ``PYTHONPATH`` in ``extra``
    put in front of the inherited one (which holds ``.gpu-site``: jsonargparse lives only there on the GPU image)."""
    env = {**os.environ, **(extra or {})}
    if extra and "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = f"{extra['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
    return env


def _subprocess_step(name: str, command: list[str], timeout: float, env: dict | None = None) -> dict[str, Any]:
    began = time.perf_counter()
    try:
        job = subprocess.run(command, cwd=ROOT, env=step_env(env), capture_output=True, text=True, timeout=timeout)
        status = "passed" if job.returncode == 0 else "failed"
        tail = (job.stdout + job.stderr)[-2500:]
    except subprocess.TimeoutExpired as err:
        status, tail = "timeout", f"still running after {timeout} s: {str(err.stdout or '')[-1500:]}"
    row = {"step": name, "status": status, "seconds": round(time.perf_counter() - began, 1)}
    return row | ({"output": tail} if status == "passed" else {"error": tail})


NOSYNC = """
import sys, torch
from lightning.pytorch import Callback
from app.command import main
from core.logging_steps import is_logging_step

CUDA = torch.cuda.is_available()  # (GPU_CHECK_CPU=1: the same run without the guard, for the wiring)

class SyncGuard(Callback):
    \"\"\"Errors on any synchronising CUDA call from the start of a non-logging training step to the next step's start
    (the step, the optimizer, the callbacks and the progress bar, fetching the next batch); logging steps may read.
    The first callback: Lightning calls them in list order, so its epoch-end reset comes before any other callback's
    allowed epoch-end read (AMPHealth's), whatever step the run ends on.\"\"\"
    checked = 0
    def mode(self, value):
        if CUDA:
            torch.cuda.set_sync_debug_mode(value)
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strict = batch_idx >= 3 and not is_logging_step(trainer)
        self.mode("error" if strict else 0)
        self.checked += strict
    def on_train_epoch_end(self, *args): self.mode(0)
    def on_validation_start(self, *args): self.mode(0)
    def on_train_end(self, *args): self.mode(0)

cli = main(sys.argv[1:], run=False)
guard = SyncGuard()
cli.trainer.callbacks.insert(0, guard)
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
print(f"no synchronising CUDA call in {guard.checked} non-logging training steps (cuda: {CUDA})")
sys.exit(0 if guard.checked else "no training step was checked: too few steps")
"""
NOSYNC_BOX_S = 55


def nosync(ctx: Context) -> list[dict]:
    """The default config's training steps under ``set_sync_debug_mode("error")``; 61 steps, logging every 50: the
    run ends on a non-logging step (the end that reported a sync which was none)."""
    steps = "61" if not CPU else "6"
    mnist = any((ROOT / "data" / "MNIST" / "raw").glob("t10k-labels-idx1-ubyte*"))
    # the default config (MNIST) when its data was carried along (no network on the GPU machine), else ImageNet's
    args = ["--trainer.max_steps", steps, "--trainer.limit_val_batches", "0", "--trainer.accelerator",
            "cpu" if CPU else "cuda", "--trainer.default_root_dir", str(ctx.workdir / "nosync"),
            "--trainer.enable_progress_bar", "false"]  # fmt: skip
    if not mnist:
        args = fit_args(ctx.workdir, "nosync", ["--trainer.max_steps", steps, "--trainer.limit_val_batches", "0"])[1:]
    script = ctx.workdir / "nosync.py"
    script.write_text(NOSYNC)
    name = "no host sync in training steps" + (" (CPU: the wiring only, no guard)" if CPU else "")
    row = _subprocess_step(name, [sys.executable, str(script), *args], box(NOSYNC_BOX_S), {"PYTHONPATH": str(ROOT)})
    row["config"] = "default (MNIST)" if mnist else "ImageNet synthetic (MNIST not in data/)"
    return [row]


def photos_env() -> dict[str, str] | None:
    """``$BENCH_PHOTOS`` for a step's process, when ``make gpu-wheels`` left the test photos in ``.gpu-wheels/photos``
    (the GPU image has no scikit-image, scikit-learn, matplotlib, whose wheels they come from)."""
    photos = ROOT / ".gpu-wheels" / "photos"
    return {"BENCH_PHOTOS": str(photos)} if photos.is_dir() else None


TESTS_BOX_S = 110  # tests/gpu, the GPU decoding ones included


def gpu_tests(ctx: Context) -> list[dict]:
    pytest = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"]
    return [_subprocess_step("tests/gpu", pytest, box(TESTS_BOX_S), photos_env())]


BENCH_BOX_S = 140


def bench_gpu(ctx: Context) -> list[dict]:
    """``bench.gpu``: it writes its results after each configuration, so a cut run keeps the finished ones."""
    args = ["--smoke", "--configs", "bf16 channels_last"] if CPU else ["--skip-mnist", "--budget-s", "80"]
    command = [sys.executable, "-m", "bench.gpu", *args, "--out", str(ctx.out)]
    return [_subprocess_step("bench.gpu", command, box(BENCH_BOX_S))]


E2E_BOX_S = 340  # JPEGs made, a cold ResNet-50 compile, 6 fits of ~60 steps, a second process restarting


def e2e(ctx: Context) -> list[dict]:
    """``bench.imagenet_e2e --determinism``: the recipe from JPEG files with each decoder against the synthetic
    compiled rate of the same process, the data wait, the restart's compile, the cost of determinism."""
    command = [sys.executable, "-m", "bench.imagenet_e2e", "--determinism", "--recipes", "classic,modern"]
    command += ["--out", str(ctx.out)]
    command += ["--smoke"] if CPU else []
    row = _subprocess_step("ImageNet end to end from JPEG files", command, box(E2E_BOX_S), photos_env())
    row["proves"] = (
        "img/s from JPEGs per decoder, classic and modern recipe, vs the synthetic compiled rate; data wait; compile "
        "cache; determinism"
    )
    try:
        found = max(ctx.out.glob("imagenet_e2e_*.json"), key=lambda p: p.stat().st_mtime)
        results = json.loads(found.read_text())
        rows = {r["input"]: r for r in results["rows"]}
        synthetic = (rows.get("synthetic") or {}).get("img_per_s")
        facts: dict[str, Any] = {"versions": results["versions"]}
        for name, r in rows.items():
            rate = r.get("img_per_s")
            facts[name] = r.get("error", "")[-200:] or {
                "img_per_s": round(rate, 1) if rate else None,
                "of_synthetic": round(rate / synthetic, 3) if rate and synthetic else None,
                "data_wait": r.get("data_wait_frac") and round(r["data_wait_frac"], 3),
                "summary_data_wait": r.get("summary_data_wait_frac") and round(r["summary_data_wait_frac"], 3),
                "first_step_s": round(r.get("first_step_s") or 0, 1),
            }
        row["facts"] = facts
    except (OSError, ValueError, KeyError) as err:
        row.setdefault("facts", {"e2e": f"unknown ({type(err).__name__})"})
    return [row]


def rehearse_kill(ctx: Context) -> list[dict]:
    """CPU rehearsal only: call A started in a subprocess, killed (SIGKILL, its whole process group) once its first
    step is written; what it left must be valid: every line JSON, the markdown listing those steps as finished and
    the call as unfinished, at most ``MAX_FILES`` files."""
    out = ctx.workdir / "killed"
    env = step_env({"GPU_CHECK_OUT": str(out)})
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_check", "--call", "A"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    rows_path, began = out / "gpu_check_A.jsonl", time.perf_counter()

    def a_fit_finished() -> bool:
        return any("global_step" in (r.get("facts") or {}) for r in read_rows(rows_path))

    while proc.poll() is None and not a_fit_finished() and time.perf_counter() - began < 300:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    row: dict[str, Any] = {"step": "a call killed part-way leaves valid results", "proves": "CPU rehearsal"}
    try:
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
        md = (out / "gpu_check_A.md").read_text()
        files = sorted(p.name for p in out.iterdir())
        problems = [f"step {r['step']!r} missing from the markdown" for r in rows[1:] if f"| {r['step']} |" not in md]
        problems += [] if "UNFINISHED" in md else ["the markdown does not say the call was cut short"]
        problems += [] if a_fit_finished() else ["no fit had finished before the kill"]
        problems += [] if proc.returncode == -signal.SIGKILL else [f"the call ended by itself ({proc.returncode})"]
        problems += [] if len(files) <= MAX_FILES else [f"{len(files)} files: {files}"]
    except (OSError, ValueError) as err:
        problems, rows, files = [f"{type(err).__name__}: {err}"], [], []
    facts = {"rows_left": len(rows), "files": files}
    return [row | {"facts": facts} | ({"status": "failed", "error": "; ".join(problems)} if problems else
                                      {"status": "passed"})]  # fmt: skip


# call -> steps (name, GPU time box in s, function); a step's box bounds all it runs (a group: its fits + start-up)
FITS_BOX_S = sum(f[2] for f in FITS) + RESUME_BOX_S + STARTUP_S
CALLS: dict[str, list[tuple[str, float, Any]]] = {
    "A": [
        ("fits", FITS_BOX_S, fits),
        ("two processes on one device", len(TWO_NODES) * PAIR_BOX_S + STARTUP_S, two_processes),
        ("no-sync", NOSYNC_BOX_S, nosync),
        ("tests/gpu", TESTS_BOX_S, gpu_tests),
    ],
    "B": [  # the end-to-end figure first: a call cut short keeps it
        ("ImageNet end to end", E2E_BOX_S, e2e),
        ("bench.gpu", BENCH_BOX_S, bench_gpu),
    ],
}


def time_boxes() -> dict[str, Any]:
    """The arithmetic every call must satisfy on the GPU: its install box plus its steps' boxes stay under
    ``CALL_LIMIT_S``."""
    totals = {call: INSTALL_BOX_S + sum(step[1] for step in steps) for call, steps in CALLS.items()}
    over = {call: total for call, total in totals.items() if total >= CALL_LIMIT_S}
    row = {
        "step": "time boxes",
        "facts": {
            "limit_s": CALL_LIMIT_S,
            "install_s": INSTALL_BOX_S,
            **{f"call {c}": {"total_s": totals[c], **{name: seconds for name, seconds, _ in CALLS[c]}} for c in CALLS},
        },
    }
    return row | ({"status": "failed", "error": f"over {CALL_LIMIT_S} s: {over}"} if over else {"status": "passed"})


def read_rows(path: Path) -> list[dict]:
    """The finished steps' rows (a line cut by a kill is not one)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def append_row(path: Path, row: dict) -> None:
    """One finished step: its JSON line appended and flushed to disk, then the call's markdown rebuilt."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if path.name.startswith("gpu_check_"):
        write_markdown(path)


def write_markdown(rows_path: Path, seconds: float | None = None) -> None:
    """``gpu_check_<call>.md`` from the call's rows, written whole then renamed: a reader never sees half of it."""
    rows = read_rows(rows_path)
    call = rows_path.stem.removeprefix("gpu_check_")
    head = rows[0] if rows and rows[0]["step"] == "call" else {"facts": {}}
    failed = sum(r.get("status") in ("failed", "timeout") for r in rows)
    state = f"finished in {seconds:.0f} s" if seconds is not None else "UNFINISHED (cut short, or still running)"
    lines = [
        f"# GPU check, call {call}{' (CPU MODE: tiny sizes, not a GPU result)' if CPU else ''}",
        "",
        f"Machine: {head['facts'].get('machine', '?')}. Command: `{head['facts'].get('command', '?')}`. "
        f"{state}; {failed} step(s) failed.",
        "",
        "| step | status | s | proves | facts / error |",
        "|---|---|---|---|---|",
    ]
    for row in rows[1:] if rows and rows[0]["step"] == "call" else rows:
        detail = json.dumps(row.get("facts")) if row.get("facts") else (row.get("error") or "")
        detail = " ".join(str(detail).split())[-400:].replace("|", "/")
        proves = (row.get("proves") or "").replace("|", "/")
        lines.append(f"| {row['step']} | {row['status']} | {row.get('seconds', '')} | {proves} | {detail} |")
    tmp = rows_path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(rows_path.with_suffix(".md"))


class Context:
    """What a call's steps share: where results go, a scratch folder, the call's rows file."""

    def __init__(self, out: Path, workdir: Path, call: str) -> None:
        self.out, self.workdir, self.rows_path = out, workdir, out / f"gpu_check_{call}.jsonl"

    def add(self, row: dict) -> None:
        append_row(self.rows_path, row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--call", choices=sorted(CALLS), required=False, help="which prepared call: A or B")
    args = parser.parse_args(argv)
    if args.group:
        run_group(args.group)
        return 0
    if not args.call:
        parser.error("--call A or --call B (make gpu-check CALL=A, then CALL=B: each fits one device command)")
    import torch

    if not CPU and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU machine, or GPU_CHECK_CPU=1 for the CPU code check")
    default_out = ROOT / "runs" / "gpu_check_cpu" if CPU else RESULTS
    out = Path(os.environ.get("GPU_CHECK_OUT") or default_out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Context(out, Path(tmp), args.call)
        ctx.rows_path.unlink(missing_ok=True)
        command = ("GPU_CHECK_CPU=1 " if CPU else "") + f"make gpu-check CALL={args.call}"
        ctx.add({"step": "call", "status": "started", "facts": {"machine": machine_line(machine()),
                 "command": command, "cpu_mode": CPU}})  # fmt: skip
        boxes = time_boxes()
        ctx.add(boxes)
        if boxes["status"] != "passed":
            print(f"error: the time boxes of the calls add up to more than {CALL_LIMIT_S} s: {boxes['error']}; "
                  "shorten the steps in bench/gpu_check.py (CALLS)")  # fmt: skip
            return 1
        steps = [*CALLS[args.call], *([("rehearsal", 300, rehearse_kill)] if CPU and args.call == "A" else [])]
        for name, seconds, step in steps:
            step_began = time.perf_counter()
            for row in step(ctx):
                ctx.add({**row, "seconds": row.get("seconds", round(time.perf_counter() - step_began, 1))})
            print(f"gpu-check {args.call}: {name} done after {time.perf_counter() - began:.0f} s "
                  f"(box {box(seconds):.0f} s)", flush=True)  # fmt: skip
    write_markdown(ctx.rows_path, time.perf_counter() - began)
    rows = read_rows(ctx.rows_path)
    failed = [r["step"] for r in rows if r.get("status") in ("failed", "timeout")]
    print(ctx.rows_path.with_suffix(".md").read_text())
    print(f"wrote {ctx.rows_path} and {ctx.rows_path.with_suffix('.md').name}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
