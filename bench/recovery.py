"""What a fault costs when the job heals itself: ``python -m bench.recovery`` (about 10 minutes on 2 CPU cores).

For each launcher that restarts a job by itself (``torchrun --max-restarts 2``; Lightning's launcher with
``--launch.max_restarts 2`` where this checkout has it) and each fault, at a mid-epoch step of a 2-process ``ddp``
MNIST fit on the CPU (gloo) with 2 DataLoader workers per rank:

- ``kill``: rank 1 is SIGKILLed (a crash, the OOM killer);
- ``hang``: rank 1 is SIGSTOPped (alive, makes no progress): the hang watch (``--launch.hang_timeout``) ends the job;
- ``worker``: one DataLoader worker of rank 1 is SIGKILLed (the OOM killer's usual victim).

It times, from the fault to the first training step after the restart: detection (the fault to the line that names
it), teardown (that line to the restarted processes' start, read from ``/proc``), process start (to the restarted
rank 0's plan: imports, parsing), rendezvous (to "All distributed processes registered"), restore (to "Restored all
states") and the first step; counts the steps trained again; and compares the final weights with the same command
never interrupted (max |difference|, which must be 0). Separately it times the pause a save of ``last.ckpt`` makes
(MNIST's net, and ResNet-50 with SGD momentum; synchronous, and in the background as by default) on this disk, as a
share of the default 10-minute checkpoint interval.
Writes ``results/recovery.{json,md}``. ``--smoke``: one launcher, one fault (a check of this script).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, ROOT, machine, machine_line, save
from tools.resume_probe import heartbeats, loader_workers

FAULT_STEP = 25  # of 40 (2 epochs of 20): mid-epoch 2, after the step-20 checkpoint
HANG_TIMEOUT = 15
DETECTED = {
    "kill": r"lost rank 1 of 2",
    "hang": r"hang watch: rank",
    # under the agent the ranks may name each other
    "worker": r"error: rank 1 \(host [^)]*\): its DataLoader worker|lost rank",
}


def fit_args(root: Path, data_dir: str) -> list[str]:
    return [
        "fit", "--trainer.default_root_dir", str(root), "--data.data_dir", data_dir,
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "20", "--trainer.limit_val_batches", "2",
        "--data.batch_size", "32", "--data.num_workers", "2", "--checkpoint.every_n_train_steps", "10",
        "--launch.hang_timeout", str(HANG_TIMEOUT), "--launch.timeout", "60",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.callbacks+=tools.resume_probe.Heartbeat", f"--trainer.callbacks.folder={root}",
        "--trainer.callbacks.pause=0.05",
    ]  # fmt: skip


def command(launcher: str, args: list[str], restarts: int) -> list[str]:
    cli = str(ROOT / "cli.py")
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--max-restarts", str(restarts), cli, *args]  # fmt: skip
    return [sys.executable, cli, *args, "--launch.max_restarts", str(restarts)]


class Job:
    """The job's processes in a session of their own, each line of their output stamped with ``time.time()``."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise RuntimeError("the job did not end in time:\n" + self.text()[-3000:]) from None
        self.reader.join(timeout=10)
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str, after: float) -> float | None:
        return next((t for t, line in self.lines if t >= after and re.search(pattern, line)), None)


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (``time.time()`` scale), from ``/proc/<pid>/stat`` and the boot time."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def inject(fault: str, root: Path, job: Job) -> tuple[float, int, int]:
    """Waits for rank 1 to finish step :data:`FAULT_STEP`, then does ``fault``; returns (when, step, rank 1 pid)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.proc.poll() is None:
        beats = heartbeats(root, 2)
        if beats and beats[1][1] >= FAULT_STEP:
            pid, step = beats[1][0], beats[1][1]
            target = loader_workers(pid)[-1] if fault == "worker" else pid  # the running epoch's worker
            os.kill(target, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
            return time.time(), step, pid
        time.sleep(0.005)
    raise RuntimeError("rank 1 never reached the fault's step:\n" + job.text()[-3000:])


def restarted(root: Path, rank: int, before: float) -> tuple[int, int, float] | None:
    """(pid, first step, time) of the first process of ``rank`` that trained a step after ``before``."""
    path = root / "heartbeat" / f"starts_rank{rank}"
    for line in path.read_text().splitlines() if path.exists() else []:
        pid, first, when = line.split()
        if float(when) > before:
            return int(pid), int(first), float(when)
    return None


def one(launcher: str, fault: str | None, data_dir: str, workdir: Path) -> dict[str, Any]:
    """One job; with a fault, its recovery timeline."""
    root = workdir / f"{launcher}-{fault or 'none'}"
    start = time.time()
    job = Job(command(launcher, fit_args(root, data_dir), restarts=2))
    row: dict[str, Any] = {"launcher": launcher, "fault": fault or "none"}
    process = None  # when the restarted rank 0 started: read from /proc while it lives
    if fault is not None:
        t0, step, _ = inject(fault, root, job)
        row["fault_at_step"] = step
        while job.proc.poll() is None and process is None:
            again = restarted(root, 0, t0)
            process = started_at(again[0]) if again else None
            time.sleep(0.05)
    code = job.wait(timeout=600)
    row["exit"], row["wall_s"] = code, time.time() - start
    (workdir / f"{launcher}-{fault or 'none'}.log").write_text(job.text())
    if code != 0:
        raise RuntimeError(f"{launcher}/{fault}: exit {code}\n" + job.text()[-4000:])
    last = torch.load(root / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    row["final_step"], row["state"] = last["global_step"], last["state_dict"]
    row["run_folders"] = len(list(root.glob("version_*")))
    if fault is None:
        return row
    again = restarted(root, 0, t0)
    detected = job.first(DETECTED[fault], t0)
    plan = job.first(r"^preflight plan", t0)
    registered = job.first(r"All distributed processes registered", t0)
    restored = job.first(r"Restored all states from the checkpoint", t0)
    marks = [t0, detected, process, plan, registered, restored, again[2] if again else None]
    names = ["detection_s", "teardown_s", "process_start_s", "rendezvous_s", "restore_s", "first_step_s"]
    for name, a, b in zip(names, marks[:-1], marks[1:], strict=True):
        row[name] = round(b - a, 2) if a is not None and b is not None else None
    row["total_s"] = round(again[2] - t0, 2) if again else None
    row["steps_recomputed"] = step - (again[1] - 1) if again else None
    return row


def stalls(folder: Path) -> list[dict[str, Any]]:
    """The pause a save of ``last.ckpt`` makes in training, synchronous and in the background (the default), for
    MNIST's net and ResNet-50: :func:`bench.checkpoint_saves.measure`."""
    from bench.checkpoint_saves import measure

    return [measure(arch, folder) for arch in ("mnist_cnn", "resnet50")]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Recovery from a fault, healed by the launcher",
        "",
        f"`{result['command']}` on {machine_line(result['machine'])}. A 2-process `ddp` MNIST fit (gloo, 2 DataLoader "
        f"workers per rank, 2 epochs of 20 steps, `last.ckpt` every 10 steps), the fault at step {FAULT_STEP}, "
        f"`--launch.hang_timeout {HANG_TIMEOUT}`, restarts allowed: 2. Seconds from the fault to the first training "
        "step after the restart; the phases add up to it.",
        "",
        "| launcher | fault | detection | teardown | process start | rendezvous | restore | first step | total | "
        "steps again | max abs diff | exit, folders |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["fault"] == "none":
            continue
        cells = [r.get(k) for k in ("detection_s", "teardown_s", "process_start_s", "rendezvous_s", "restore_s",
                                    "first_step_s", "total_s")]  # fmt: skip
        shown = " | ".join("?" if c is None else f"{c:.1f}" for c in cells)
        lines.append(
            f"| {r['launcher']} | {r['fault']} | {shown} | {r['steps_recomputed']} | {r['max_abs_diff']:g} | "
            f"{r['exit']}, {r['run_folders']} |"
        )
    lines += ["", "Uninterrupted, the same command: " + ", ".join(
        f"{r['launcher']} {r['wall_s']:.1f} s" for r in result["rows"] if r["fault"] == "none") + "."]  # fmt: skip
    lines += ["", "What a save of `last.ckpt` pauses training, against the default 10-minute interval "
              "(`--checkpoint.interval_minutes`; median of 5, `bench/checkpoint_saves.py`): in the background (the "
              "default) training waits only while the state is copied to host memory.", "",
              "| network (SGD with momentum) | size | synchronous save | background: pause | share of 10 min |",
              "|---|---|---|---|---|"]  # fmt: skip
    for s in result["stalls"]:
        lines.append(f"| {s['arch']} | {s['mb']:.1f} MB | {s['sync_s']:.3f} s | {s['background_pause_s']:.3f} s | "
                     f"{s['background_pause_share']:.3%} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="torchrun and one fault (kill) only")
    parser.add_argument("--launchers", nargs="+", default=["torchrun", "lightning"])
    parser.add_argument("--faults", nargs="+", default=["kill", "hang", "worker"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from datamodules.mnist import ensure_mnist

    data_dir = str(ensure_mnist(ROOT / "data"))
    launchers, faults = (["torchrun"], ["kill"]) if args.smoke else (args.launchers, args.faults)
    out = ROOT / "runs" / "bench-smoke" if args.smoke else args.out
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        for launcher in launchers:
            reference = one(launcher, None, data_dir, Path(tmp))
            rows.append(reference)
            for fault in faults:
                row = one(launcher, fault, data_dir, Path(tmp))
                theirs = reference["state"]
                row["max_abs_diff"] = max((row["state"][k].double() - theirs[k].double()).abs().max().item()
                                          for k in theirs if theirs[k].is_floating_point())  # fmt: skip
                rows.append(row)
                print(f"{launcher} {fault}: {row.get('total_s')} s, max |diff| {row['max_abs_diff']:g}", flush=True)
        found = stalls(Path(tmp))
    for row in rows:
        row.pop("state")
    result = {"command": "python -m bench.recovery" + (" --smoke" if args.smoke else ""), "machine": machine(),
              "rows": rows, "stalls": found}  # fmt: skip
    save(out, "recovery", result, markdown)


if __name__ == "__main__":
    main()
