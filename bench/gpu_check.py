"""The prepared GPU check: ``make gpu-check CALL=A`` then ``CALL=B`` (``python -m bench.gpu_check --call A|B``).

Two calls, each under ``CALL_LIMIT_S`` (300 s) of wall time with the offline install and every interpreter start,
because the GPU machine runs one command for at most 300 s here and brings back only what it wrote. Each step is
time-boxed (``CALLS``: the boxes, the install and the call's own start add up to ``CALL_LIMIT_S - MARGIN_S`` at most,
checked before anything runs; each box's estimate is printed as it starts), and a failing step is recorded while the
rest still run:

- call A: short fits of the ImageNet config (synthetic data, resnet18) in every mode one GPU allows, each labelled
  with what it proves, and whether the world-1 modes (same seed, same data) end at the same loss; each precision and
  channels_last; ``ddp`` and ``allreduce`` with 2 processes sharing the GPU over gloo (a real all-reduce of CUDA
  tensors), or with 2 GPUs or more a 2-process DDP fit of the default config instead; ``tests/gpu`` (resume from
  ``last.ckpt`` and the no-sync check of the default config's steps are tests there).
- call B: ``bench.imagenet_e2e`` (the ImageNet recipe trained from JPEG files with each decoder, classic and with the
  modern recipe's augmentations, beside the same process's synthetic compiled rate, and the data wait), then one
  batch of JPEG files through a hardware-only nvImageCodec decoder with the training path's crop regions (the count
  of files the engine refused) and a fit from those files that runs validation batches (the evaluation path).

Each call writes as it goes into ``$GPU_CHECK_OUT`` (default ``bench/results/``): one JSON line per finished step in
``gpu_check_<call>.jsonl`` and ``gpu_check_<call>.md`` rebuilt from it after each step, so a call cut short returns
everything that finished; at most ``MAX_FILES`` (6) files per call. With ``GPU_CHECK_CPU=1`` the same steps run on the
CPU at tiny sizes (what needs CUDA is skipped, saying why; the DDP fit runs on 2 CPU processes over gloo), into
``runs/gpu_check_cpu/`` unless ``GPU_CHECK_OUT`` is set, and a rehearsal step kills a call part-way and checks what
it left. Exit status 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
CALL_LIMIT_S = 300  # the device runs one command for at most 300 s here
MARGIN_S = 30  # left over in every call: the boxes are estimates from one H200 run, the first run finds what is new
INSTALL_BOX_S = 40  # `make gpu-check`'s offline install (pip --no-index, 4 small packages), `timeout` in the Makefile
STARTUP_S = 15  # an interpreter's imports (torch, lightning, the app): `import lightning.pytorch` took 13.9 s there
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

    # single device 17.4 s measured (CUDA start, cuDNN autotuning), the modes after it 1.7-2.5 s each
    fits: list[Fit] = [
        ("mode single device", ["--trainer.strategy", "auto"], 22, "the baseline: TF32 on, cudnn.benchmark", None)
    ]
    for name in declared_modes(variants=False):
        layout = layout_of(name, 1)
        if layout.one_process:
            fits.append((f"mode {name} (1 GPU)", ["--trainer.strategy", name], 5, WORLD1, None))
        elif layout.needs_process_gpus:
            cls = StrategyRegistry[name]["strategy"]  # a class takes arguments, a registered name does not
            one = [f"--trainer.strategy={cls.__module__}.{cls.__qualname__}"]
            one += ["--trainer.strategy.init_args.devices_per_process", "1"]
            fits.append((f"mode {name} (1 device per process)", one, 5, WORLD1, None))
        else:
            fits.append(
                (f"mode {name} (NCCL, world 1)", ["--trainer.strategy", name], 5, f"NCCL starts; {WORLD1}", None)
            )
    return fits


# cuDNN's autotuning of each new dtype or memory format was 10-12 s of the 11-14 s these fits took on the H200, and
# proves nothing the baseline's does not: off here, so that they fit the 300 s call
UNTUNED = ["--trainer.benchmark", "false"]
FITS: list[Fit] = [
    *mode_fits(),
    (
        "precision 16-mixed (GradScaler)",
        ["--trainer.precision", "16-mixed", *UNTUNED],
        6,
        "fp16 autocast + GradScaler on CUDA",
        "fp16 AMP needs CUDA (refused on CPU)",
    ),  # fmt: skip
    ("precision bf16-mixed", ["--trainer.precision", "bf16-mixed", *UNTUNED], 6, "bf16 autocast on CUDA", None),
    (
        "precision 16-true",
        ["--trainer.precision", "16-true", *UNTUNED],
        4,
        "fp16 weights, SGD; fp32 metric sums",
        "fp16 convolutions are slow on a CPU; bf16-true runs the same code",
    ),  # fmt: skip
    ("precision bf16-true", ["--trainer.precision", "bf16-true", *UNTUNED], 4, "bf16 weights; fp32 metric sums", None),
    ("channels_last", ["--model.channels_last", "true", *UNTUNED], 6, "NHWC weights and inputs on cuDNN", None),
]
# (no resume fit here: tests/gpu's test_a_fit_resumes_from_last_ckpt_on_cuda stops a fit by SIGTERM and resumes it)


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
PAIR_BOX_S = 10  # per fit of the pair (10.1 and 2.4 s measured, cuDNN autotuning included: off now)


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
    file), so a process killed part-way loses only what was left. None saves checkpoints. A spec with ``jpegs``
    first writes those JPEG files and counts what the hardware engine refused of them (:func:`jpeg_files`)."""
    from app.command import main

    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGALRM, _alarm)
    if spec.get("jpegs"):
        append_row(Path(spec["results"]), jpeg_files(spec["jpegs"]))
    for item in spec["items"]:
        began, record = time.perf_counter(), {"step": item["name"], "proves": item.get("proves")}
        signal.alarm(max(1, round(item["timeout"])))
        try:
            cli = None
            cli = main(item["args"], cli_class=_cli_saving_nothing())
            record |= {"status": "passed", "facts": _facts(cli.trainer)}
            if item.get("expect_step") and cli.trainer.global_step != item["expect_step"]:
                record |= {"status": "failed", "error": f"global_step {cli.trainer.global_step}, "
                           f"expected {item['expect_step']}"}  # fmt: skip
            if item.get("expect_val") and "val/loss" not in record["facts"]:
                record |= {"status": "failed", "error": "no validation metric: the evaluation did not run"}
        except _Timeout:
            record |= {"status": "timeout", "error": f"still running after {item['timeout']} s"}
        except BaseException as err:  # noqa: BLE001 (SystemExit from the CLI included: record, go on)
            record |= {"status": "failed", "error": f"{type(err).__name__}: {err}"[-3000:]}
        finally:
            signal.alarm(0)
        record["seconds"] = round(time.perf_counter() - began, 1)
        append_row(Path(spec["results"]), record)


def _group(
    items: list[dict], results: Path, workdir: Path, tag: str, env: dict | None = None, jpegs: dict | None = None
) -> subprocess.Popen:
    (workdir / f"{tag}.json").write_text(json.dumps({"items": items, "results": str(results), "jpegs": jpegs}))
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
        items.append({"name": _cpu_name(name), "args": fit_args(ctx.workdir, name, extra), "timeout": box(seconds),
                      "expect_step": z["steps"], "proves": _cpu_name(proves)})  # fmt: skip
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


def shared_device_pair(ctx: Context) -> list[dict]:
    """ddp and allreduce with 2 processes sharing the one device (two simulated nodes; NCCL refuses two ranks on
    one GPU): a real all-reduce of CUDA tensors over gloo. Rows from both processes are merged, the worst kept."""
    z, pair = sizes(), []
    for name, extra in TWO_NODES:
        args = fit_args(ctx.workdir, name, [*extra, "--trainer.num_nodes", "2", *UNTUNED])
        args += ["--trainer.strategy.init_args.process_group_backend", "gloo"]
        pair.append(
            {
                "name": name,
                "args": args,
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
    """The command as one step, in a session of its own: when its box runs out the whole group is killed (DDP's
    second rank, loader workers), not only the process started here."""
    began = time.perf_counter()
    job = subprocess.Popen(command, cwd=ROOT, env=step_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # fmt: skip
    try:
        output = job.communicate(timeout=timeout)[0]
        status, tail = "passed" if job.returncode == 0 else "failed", output[-2500:]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        status, tail = "timeout", f"still running after {timeout} s: {job.communicate()[0][-1500:]}"
    row = {"step": name, "status": status, "seconds": round(time.perf_counter() - began, 1)}
    return row | ({"output": tail} if status == "passed" else {"error": tail})


DDP_BOX_S = 45  # rank 0 starts, then starts rank 1 (two interpreter starts in series), a few steps of MNIST


def ddp_fit(ctx: Context) -> dict[str, Any]:
    """A short fit of the default config (MNIST; the ImageNet config on synthetic data when MNIST was not carried
    along) with ``--trainer.devices 2 --trainer.strategy ddp``: 2 GPUs over NCCL, or 2 CPU processes over gloo."""
    devices = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_steps", "4",
               "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0"]  # fmt: skip
    args = ["fit", *devices, "--trainer.accelerator", "cpu" if CPU else "cuda", "--trainer.default_root_dir",
            str(ctx.workdir / "ddp"), "--trainer.enable_progress_bar", "false"]  # fmt: skip
    mnist = any((ROOT / "data" / "MNIST" / "raw").glob("t10k-labels-idx1-ubyte*"))
    if not mnist:  # (no network on the GPU machine)
        args = fit_args(ctx.workdir, "ddp", devices)
    name = "DDP, 2 processes" + (" (2 CPU processes, gloo: the wiring)" if CPU else " (2 GPUs, NCCL)")
    row = _subprocess_step(name, [sys.executable, "cli.py", *args], box(DDP_BOX_S))
    row["proves"] = "Lightning starts the second rank, DistributedSampler, a real all-reduce between 2 devices"
    # the training summary's lines: what ran, as the run itself counted it
    said = dict(re.findall(r"^(steps|world size|strategy|devices)\s{2,}(\S.*?)\s*$", row.get("output", ""), re.M))
    if row["status"] == "passed" and (said.get("world size"), said.get("steps")) != ("2", "4"):
        row |= {"status": "failed", "error": f"not 4 steps at world size 2: {said}"}
    return row | {"facts": said, "config": "default (MNIST)" if mnist else "ImageNet synthetic (MNIST not in data/)"}


def two_processes(ctx: Context) -> list[dict]:
    """With 2 GPUs or more the DDP fit on 2 of them, else the pair sharing one GPU (each box holds either; on the
    CPU both run, rehearsing the wiring)."""
    import torch

    gpus = 0 if CPU else torch.cuda.device_count()
    pair = [{"step": f"{n} (2 processes)", "status": "skipped", "error": f"{gpus} GPUs: the DDP fit runs instead"}
            for n, _ in TWO_NODES] if gpus >= 2 else shared_device_pair(ctx)  # fmt: skip
    for row in pair:  # written now, before the DDP fit starts
        ctx.add(row)
    return [ddp_fit(ctx) if CPU or gpus >= 2 else {"step": "DDP, 2 processes", "status": "skipped", "error": "1 GPU"}]


def photos_env() -> dict[str, str] | None:
    """``$BENCH_PHOTOS`` for a step's process, when ``make gpu-wheels`` left the test photos in ``.gpu-wheels/photos``
    (the GPU image has no scikit-image, scikit-learn, matplotlib, whose wheels they come from)."""
    photos = ROOT / ".gpu-wheels" / "photos"
    return {"BENCH_PHOTOS": str(photos)} if photos.is_dir() else None


TESTS_BOX_S = 85  # tests/gpu, the GPU decoding ones included: 58 and 67 s on the H200 (a resume test 45 s of it)


def gpu_tests(ctx: Context) -> list[dict]:
    pytest = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"]
    return [_subprocess_step("tests/gpu", pytest, box(TESTS_BOX_S), photos_env())]


# JPEGs made, a cold ResNet-50 compile, 5 fits of ~60 steps (est. 150 s). Left out to fit the 300 s call: the restart
# in a second process (an interpreter start and the compile cache's load, ~40 s) and the deterministic fit (a
# recompile, ~50 s); `python -m bench.imagenet_e2e --determinism` runs them as a call of its own
E2E_BOX_S = 175


def e2e(ctx: Context) -> list[dict]:
    """``bench.imagenet_e2e``: the recipe from JPEG files with each decoder, classic and modern, against the
    synthetic compiled rate of the same process, and the data wait."""
    command = [sys.executable, "-m", "bench.imagenet_e2e", "--decoders", "gpu,cpu", "--recipes", "classic,modern"]
    command += ["--no-restart"]
    command += ["--out", str(ctx.out)]
    command += ["--smoke"] if CPU else []
    row = _subprocess_step("ImageNet end to end from JPEG files", command, box(E2E_BOX_S), photos_env())
    row["proves"] = "img/s from JPEGs per decoder, classic and modern recipe, vs the synthetic compiled rate; data wait"
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


HARDWARE_BOX_S = 10  # 256 JPEGs made (~4 s), nvImageCodec imported, one batch decoded
EVALUATION_BOX_S = 15  # a fit's first CUDA work, loader workers, 2 training and 3 validation batches (est. 7 s)


def jpeg_files(spec: dict[str, Any]) -> dict[str, Any]:
    """In the group process, before its fit: ``count`` JPEG files in ``train/`` and ``val/`` class folders, and what
    a hardware-only nvImageCodec decoder does with one batch of them, each cropped to the region
    ``RandomResizedCrop`` draws (as the training path decodes it): the files it refused (``None``), which training
    decodes again on a slower backend. On the CPU its CPU backend runs the same calls."""
    from bench.loader import make_jpegs

    row: dict[str, Any] = {"step": "hardware JPEG engine, one batch", "proves": "the engine decodes the training "
                           "path's crop regions: None = refused, decoded again on a slower backend"}  # fmt: skip
    began = time.perf_counter()
    signal.alarm(max(1, round(spec["timeout"])))
    try:
        folder = Path(spec["folder"])
        paths = make_jpegs(folder / "flat", spec["count"], tuple(spec["size"]))
        for split in ("train", "val"):  # the same files, 4 classes
            for path in paths:
                (folder / split / f"class{int(path.stem) % 4}").mkdir(parents=True, exist_ok=True)
                os.link(path, folder / split / f"class{int(path.stem) % 4}" / path.name)
        row |= hardware_count(paths)
    except _Timeout:
        row |= {"status": "timeout", "error": f"still running after {spec['timeout']} s"}
    except Exception as err:  # noqa: BLE001 (the row says why; the fit still runs)
        row |= {"status": "failed", "error": f"{type(err).__name__}: {err}"[-2000:]}
    finally:
        signal.alarm(0)
    return row | {"seconds": round(time.perf_counter() - began, 1)}


def hardware_count(paths: list[Path]) -> dict[str, Any]:
    """One batch through ``Decoder(backends=[Backend(BackendKind.HW_GPU_ONLY)])``: how many it refused, and how many
    came back another size than their region. Its creation fails on a GPU without the engine: that is the result."""
    import torch
    from PIL import Image
    from torchvision.transforms import v2

    if not CPU:
        torch.cuda.set_device(0)  # nvJPEG's hardware backend makes its handle on the current device
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    from nvidia import nvimgcodec as nv

    kind, where = ("CPU_ONLY", {"device_id": nv.NVIMGCODEC_DEVICE_CPU_ONLY}) if CPU else ("HW_GPU_ONLY", {})
    try:
        decoder = nv.Decoder(backends=[nv.Backend(getattr(nv.BackendKind, kind))], **where)
    except Exception as err:  # noqa: BLE001 (no engine on this GPU)
        return {"status": "no engine", "facts": {"backend": kind}, "error": f"{type(err).__name__}: {err}"[-500:]}
    crop, streams, boxes = v2.RandomResizedCrop(224), [], []
    for path in paths:
        with Image.open(path) as header:  # the header only, as the loader workers draw the box
            drawn = crop.make_params([header])
        top, left, height, width = drawn["top"], drawn["left"], drawn["height"], drawn["width"]
        region = nv.Region(top, left, top + height, left + width)
        streams.append(nv.CodeStream(path.read_bytes()).get_sub_code_stream(region=region))
        boxes.append((height, width))
    began = time.perf_counter()
    decoded = decoder.decode(streams, params=nv.DecodeParams(color_spec=nv.SRGB, apply_exif_orientation=True))
    if not CPU:
        torch.cuda.synchronize()
    refused = sum(image is None for image in decoded)
    wrong = sum(
        image is not None and tuple(image.shape[:2]) != size for image, size in zip(decoded, boxes, strict=True)
    )
    facts = {"backend": kind, "images": len(paths), "refused (None)": refused, "another size": wrong,
             "decode_s": round(time.perf_counter() - began, 3), "nvimgcodec": nv.__version__}  # fmt: skip
    return {"status": "failed" if wrong else "refused some" if refused else "passed", "facts": facts}


def jpegs(ctx: Context) -> list[dict]:
    """The JPEG files, the hardware engine's count (:func:`jpeg_files`), then a fit from them with validation
    batches (the evaluation path: its geometry and GPU decoding; eager resnet18: a compile does not fit the call)."""
    (count, size), folder = (8, (64, 48)) if CPU else (256, (500, 375)), ctx.workdir / "jpegs"
    extra = ["--data.synthetic", "false", "--data.data_dir", str(folder), "--data.decode", "gpu",
             "--trainer.precision", "bf16-mixed", "--model.channels_last", "true", *UNTUNED,
             "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "3"]  # fmt: skip
    item = {"name": "evaluation from JPEG files", "args": fit_args(ctx.workdir, "evaluation", extra),
            "timeout": box(EVALUATION_BOX_S), "expect_step": 2, "expect_val": True,
            "proves": "3 validation batches decoded on the GPU (resize, centre crop), bf16 channels_last"}  # fmt: skip
    spec = {"folder": str(folder), "count": count, "size": size, "timeout": box(HARDWARE_BOX_S)}
    proc = _group([item], ctx.rows_path, ctx.workdir, "jpegs", photos_env(), jpegs=spec)  # (photos: for the JPEGs)
    _wait([proc], item["timeout"] + spec["timeout"] + STARTUP_S)
    return _missing([item], ctx.rows_path, ctx.workdir, "jpegs", proc)


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


# call -> steps (name, GPU time box in s, function); a step's box bounds all it runs (a group: its fits + start-up).
# Each call: INSTALL_BOX_S + STARTUP_S (its own start) + its boxes <= CALL_LIMIT_S - MARGIN_S. Before: 520 and 522 of
# 540 s; what left to fit 300: bench.gpu (its rates are measured: bench/results/gpu_*_NVIDIA-H200.md), the no-sync
# and resume fits (tests in tests/gpu), the e2e's restart and deterministic fit (see E2E_BOX_S)
FITS_BOX_S = sum(f[2] for f in FITS) + STARTUP_S
PAIR_BOX_S_ALL = len(TWO_NODES) * PAIR_BOX_S + STARTUP_S
CALLS: dict[str, list[tuple[str, float, Any]]] = {
    "A": [
        ("fits", FITS_BOX_S, fits),
        ("two processes", max(PAIR_BOX_S_ALL, DDP_BOX_S), two_processes),  # one or the other runs on a GPU
        ("tests/gpu", TESTS_BOX_S, gpu_tests),
    ],
    "B": [  # the end-to-end figure first: a call cut short keeps it
        ("ImageNet end to end", E2E_BOX_S, e2e),
        ("JPEG files: hardware engine, evaluation", HARDWARE_BOX_S + EVALUATION_BOX_S + STARTUP_S, jpegs),
    ],
}


def time_boxes() -> dict[str, Any]:
    """The arithmetic every call must satisfy on the GPU: its install box, its own start and its steps' boxes stay
    ``MARGIN_S`` under ``CALL_LIMIT_S``."""
    totals = {call: INSTALL_BOX_S + STARTUP_S + sum(step[1] for step in steps) for call, steps in CALLS.items()}
    over = {call: total for call, total in totals.items() if total > CALL_LIMIT_S - MARGIN_S}
    row = {
        "step": "time boxes",
        "facts": {
            "limit_s": CALL_LIMIT_S,
            "margin_s": MARGIN_S,
            "install_s": INSTALL_BOX_S,
            "start_s": STARTUP_S,
            **{f"call {c}": {"total_s": totals[c], **{name: seconds for name, seconds, _ in CALLS[c]}} for c in CALLS},
        },
    }
    over_by = f"over {CALL_LIMIT_S} - {MARGIN_S} s: {over}"
    return row | ({"status": "failed", "error": over_by} if over else {"status": "passed"})


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
            print(f"error: the time boxes of the calls add up to more than allowed: {boxes['error']}; "
                  "shorten the steps in bench/gpu_check.py (CALLS)")  # fmt: skip
            return 1
        total = boxes["facts"][f"call {args.call}"]["total_s"]
        print(f"gpu-check {args.call}: {total} s of the {CALL_LIMIT_S} s call planned: the install ({INSTALL_BOX_S} "
              f"s at most), this start (~{STARTUP_S} s), then each box", flush=True)  # fmt: skip
        rehearsal = [("rehearsal (CPU only: no GPU box)", 0, rehearse_kill)] if CPU and args.call == "A" else []
        steps = [*CALLS[args.call], *rehearsal]
        for name, seconds, step in steps:
            cpu = f" (on the CPU: {box(seconds):.0f} s allowed)" if CPU else ""
            print(f"gpu-check {args.call}: box {name}: ~{seconds:.0f} s of the {CALL_LIMIT_S} s call{cpu}", flush=True)
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
