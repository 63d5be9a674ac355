"""``python cli.py fit --trainer.devices 2 --trainer.strategy ddp --launch.max_restarts K`` (no torchrun): torch's
elastic agent runs the ranks (``app.launch.elastic``) and a fault heals itself; under ``torchrun --max-restarts K``
the same. Real 2-process gloo jobs on MNIST:

- under Lightning's launcher, rank 1 asleep mid-epoch 0 until the hang watch ends the attempt, then SIGKILLed
  mid-epoch 1: the job exits 0 in one run folder, says each restart once, and ends with the same weights bit for bit
  and the same samples at each step as the same command never interrupted under Lightning's own launcher
  (``--launch.max_restarts 0``);
- under torchrun, one job with three faults in turn: rank 1 SIGKILLed as it starts, then stuck while the job
  starts, then a worker of its DataLoader SIGKILLed; the same end. (A rank dead at start and a lost loader worker
  end the rank as a SIGKILL does, as the agent sees them; the agent is the same code under both launchers, so each
  fault runs on one of them. A rank asleep under torchrun is named in ``test_hangs.py``.)
- rank 1 SIGKILLed in every attempt: the restarts are used up, the parent exits 1 with one ``error:`` line and no
  traceback;
- SIGTERM to the parent: the agent stops the ranks, which save ``last.ckpt`` and exit;
- an elastic torchrun job (``--nnodes 1:2``, W&B on) whose rank 1 the test SIGKILLs from outside continues the same
  run folder, TensorBoard version and W&B run.

No process of a job is left behind (its processes are found by a variable of the test's in their environment: the
agent starts the ranks in sessions of their own).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.checkpoint import local_folder
from tests.conftest import ROOT, short_fit
from tests.distributed.test_faults import HEARTBEAT, beats
from tests.troubleshooting import assert_documented
from tests.wandb_reader import offline_runs, requires_wandb, tensorboard_scalars
from tools.resume_probe import per_step

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("timing")]

EPOCHS, BATCHES, EVERY = 2, 6, 2  # 12 steps; last.ckpt every 2 steps once a validation has run (the monitor's metric)
FAULT_AT = 10  # rank 1 fails at the end of the batch that makes step 9: mid-epoch 1, one step after the save of step 8
MARK = "LAUNCHER_HEALS_TEST_JOB"  # in the environment of every process of a job (the agent copies it to the ranks)


def job_args(mnist_dir: Path, root: Path, *extra: str) -> list[str]:
    return [
        str(ROOT / "cli.py"), "fit", *short_fit(root, mnist_dir, BATCHES, 2, epochs=EPOCHS, batch_size=16),
        "--trainer.devices", "2", "--trainer.strategy", "ddp", "--seed_everything", "7", "--launch.timeout", "60",
        "--checkpoint.every_n_train_steps", str(EVERY),
        "--trainer.callbacks+=tools.resume_probe.SampleLog", f"--trainer.callbacks.folder={root}", *extra,
    ]  # fmt: skip


def fault(probe: str, *extra: str, step: int = FAULT_AT, attempt: int | None = 0) -> list[str]:
    """``probe`` (``SignalAt`` / ``HangAt`` of ``tools.resume_probe``) on rank 1 at ``step``, in the first attempt
    only (``attempt`` None: in every attempt)."""
    args = [f"--trainer.callbacks+=tools.resume_probe.{probe}", "--trainer.callbacks.step", str(step)]
    args += ["--trainer.callbacks.rank", "1", *extra]
    return args + (["--trainer.callbacks.attempt", str(attempt)] if attempt is not None else [])


def start(args: list[str], root: Path, environ: dict | None = None) -> subprocess.Popen:
    """``python ARGS`` in ``environ`` (default: this process's), marked as this job's."""
    env = {**(os.environ if environ is None else environ), "PYTHONUNBUFFERED": "1", MARK: str(root)}
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def run(args: list[str], root: Path, timeout: float = 300) -> tuple[int, str]:
    job = start(args, root)
    try:
        out, _ = job.communicate(timeout=timeout)
    finally:
        job.kill()
    nothing_left(root)
    return job.returncode, out


def processes_of(root: Path) -> list[int]:
    """Live processes (not zombies) whose environment carries this job's :data:`MARK`."""
    found, mark = [], f"{MARK}={root}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            alive = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, IndexError):
            continue
    return found


def nothing_left(root: Path) -> None:
    deadline = time.monotonic() + 10
    while processes_of(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_of(root)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def last_of(root: Path) -> dict:
    (version,) = root.glob("version_*")  # one run folder, whatever the attempts
    assert version.name == "version_0", version
    return torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(mnist_dir, tmp_path_factory) -> Path:
    """The same job under Lightning's own launcher, never interrupted: the run the healed jobs must equal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    code, out = run(job_args(mnist_dir, root, "--launch.max_restarts", "0"), root)
    assert code == 0, out[-4000:]
    assert "launcher     none (Lightning starts the local processes)" in out, out[-4000:]
    assert last_of(root)["global_step"] == EPOCHS * BATCHES
    return root


def assert_healed(out: str, root: Path, reference: Path, resumed: list[int]) -> None:
    """Each restart in ``resumed`` resumed the newest ``last.ckpt`` through its node-local copy (the launcher restarts
    in place; the copy is removed when the job ends); the job ends with the uninterrupted job's weights and samples in
    one run folder, and its training summary counts each fault healed and the time it cost."""
    assert "Traceback" not in out, out[-6000:]
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    for restart in resumed:
        assert f"resume: {last} (torchrun restart {restart}: the newest last.ckpt of job" in out, out[-6000:]
    local = local_folder(last.parent) / "last.ckpt"
    reads = [line for line in out.splitlines() if line.startswith("resume: reading ")]
    assert reads == [f"resume: reading {local}, the node-local copy of {last} (the same SHA-256)"] * len(resumed), out[
        -6000:
    ]
    assert not local.parent.exists()  # removed when the job ended
    ours, theirs = last_of(root), last_of(reference)
    assert ours["global_step"] == EPOCHS * BATCHES
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in theirs["state_dict"].items()), "weights differ"
    for rank in (0, 1):
        steps = per_step(root, rank)
        assert len(steps) == EPOCHS * BATCHES and steps == per_step(reference, rank), rank
    faults = json.loads((root / "version_0" / "summary.json").read_text())["faults"]
    assert [f["restart"] for f in faults] == resumed, faults
    assert all(f["launcher"] == "torch's elastic agent" and f["lost_s"] > 0 for f in faults), faults


def hang_lines(out: str) -> list[str]:
    """The allowance each hang watch diagnosis of rank 1 names, in order."""
    hangs = [line for line in out.splitlines() if line.startswith("error: hang watch: rank 1 of 2 is stuck")]
    return [line.split(" s ")[-1].split(" Help:")[0] for line in hangs]


def test_under_lightnings_launcher_a_hung_rank_then_a_killed_rank_each_restart_the_group(
    mnist_dir, tmp_path, uninterrupted
):
    """``--launch.max_restarts 2``: rank 1 asleep mid-epoch 0 until the hang watch ends the attempt (attempt 0), then
    SIGKILLed mid-epoch 1 (attempt 1). Each restart is said once and resumes the newest ``last.ckpt``."""
    faults = fault("HangAt", step=6, attempt=0)
    faults += fault("SignalAt", "--trainer.callbacks.sigkill", "true", attempt=1)
    args = job_args(mnist_dir, tmp_path, "--launch.max_restarts", "2", "--launch.hang_timeout", "10", *faults)
    code, out = run(args, tmp_path)
    assert code == 0, out[-6000:]
    assert "launcher     torch's elastic agent, started by this process (--launch.max_restarts 2)" in out, out[-4000:]
    assert hang_lines(out) == ["(--launch.hang_timeout 10)."], out[-6000:]
    assert f"torchrun: lost rank 1 of 2 (on {socket.gethostname()}: " in out, out[-6000:]  # the lost rank's node
    said = [line for line in out.splitlines() if "restarts the worker group" in line]
    assert len(said) == 2 and all(f"(restart {n} of 2)" in line for n, line in enumerate(said, 1)), said
    assert_healed(out, tmp_path, uninterrupted, resumed=[1, 2])
    assert re.search(r"^ *restarts +2 \(torch's elastic agent\), ", out, re.M), out[-3000:]


def test_restarts_used_up_end_the_job_with_one_line(mnist_dir, tmp_path):
    # killed in every attempt, early in the first epoch (before any checkpoint): both attempts fail the same way
    kill = fault("SignalAt", "--trainer.callbacks.sigkill", "true", step=3, attempt=None)
    code, out = run(job_args(mnist_dir, tmp_path, "--launch.max_restarts", "1", *kill), tmp_path)
    assert code == 1, out[-5000:]
    line = assert_documented(out, "restarts-used-up")
    assert line.startswith("error: rank 1 (pid ") and "was killed by SIGKILL" in line and "(1 of 1 used)" in line, line
    assert "Traceback" not in out, out[-5000:]
    assert out.count("restarts the worker group (restart 1 of 1)") == 1, out[-5000:]


def test_sigterm_to_the_parent_stops_every_rank(mnist_dir, tmp_path):
    job = start(job_args(mnist_dir, tmp_path, "--launch.max_restarts", "2", "--trainer.max_epochs", "1000"), tmp_path)
    try:
        samples = tmp_path / "samples_rank1.jsonl"
        deadline = time.monotonic() + 120
        while not (samples.is_file() and len(samples.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
            assert job.poll() is None, job.communicate()[0][-4000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    nothing_left(tmp_path)
    assert job.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert last_of(tmp_path)["global_step"] >= 3  # the ranks stopped at a step boundary with a checkpoint


def test_under_torchrun_a_rank_dead_at_start_stuck_starting_and_a_lost_loader_worker_each_heal(
    mnist_dir, tmp_path, uninterrupted
):
    """``torchrun --max-restarts 3``, one fault per attempt, all on rank 1: SIGKILLed as it reads its configuration,
    before the process group forms (attempt 0); asleep in ``on_train_start`` until the hang watch's start-up
    allowance (``--launch.startup_timeout``) ends the attempt (1); a worker of its training DataLoader SIGKILLed
    mid-epoch 1 (2). The last attempt ends the job in one run folder with the uninterrupted run's weights and
    samples."""
    faults = ["--trainer.callbacks+=tools.resume_probe.DieStarting", "--trainer.callbacks.attempt", "0"]
    faults += ["--trainer.callbacks+=tools.resume_probe.HangIn", "--trainer.callbacks.attempt", "1"]
    faults += ["--launch.startup_timeout", "20"]
    faults += fault("KillLoaderWorkerAt", step=FAULT_AT, attempt=2)
    args = job_args(mnist_dir, tmp_path, "--data.num_workers", "1", *faults)
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "3", *args]
    code, out = run(args, tmp_path, timeout=400)
    assert code == 0, out[-6000:]
    assert "launcher     torchrun" in out, out[-6000:]
    assert hang_lines(out) == ["(--launch.startup_timeout 20: the job is starting)."], out[-6000:]
    assert f"error: rank 1 (host {socket.gethostname()}): its DataLoader worker (pid " in out, out[-6000:]
    # restart 1 started from scratch (nothing was saved when rank 1 died starting); stuck in restart 1 before any
    # save, restart 2 starts over in the same folder
    assert "resume: nothing saved yet; continuing version_0, which this job started" in out, out[-6000:]
    assert_healed(out, tmp_path, uninterrupted, resumed=[3])


@requires_wandb
def test_elastic_restart_after_a_killed_worker_continues_the_same_run(mnist_dir, tmp_path, uninterrupted):
    """``torchrun --max-restarts 1 --nnodes 1:2`` with W&B on (offline): the test SIGKILLs rank 1 once, mid-epoch 1,
    after a mid-epoch ``last.ckpt``; torchrun restarts the group, which resumes from that checkpoint in the same
    version folder, TensorBoard version and W&B run, and ends as the uninterrupted job: the same weights bit for bit,
    and every rank trained the same samples at each step (a step trained again after the restart counts once)."""
    args = job_args(mnist_dir, tmp_path, "--trainer.num_nodes", "2", f"--trainer.callbacks+={HEARTBEAT}")  # 1:2's top
    args += ["--config", str(ROOT / "configs" / "logger" / "wandb.yaml")]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, "WANDB_MODE": "offline"}
    # --standalone with a node range: torchrun waits last_call_timeout (30 s by default) for more nodes
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--nnodes", "1:2",
               "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1", *args]  # fmt: skip
    job = start(command, tmp_path, env)
    try:
        killed = None
        while killed is None and job.poll() is None:  # once, mid-epoch 1, one step after the save of step 8
            found = beats(tmp_path, ranks=2)
            if found and found[1][1] >= FAULT_AT:
                killed = found[1]
                os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.05)
        log, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    nothing_left(tmp_path)
    assert killed is not None and job.returncode == 0, log[-5000:]
    said = [line for line in log.splitlines() if "lost rank" in line]
    assert len(said) == 1 and said[0].startswith("torchrun: lost rank 1 of 2 ("), said
    assert "torchrun restarts the worker group (restart 1 of 1)" in said[0] and "no longer answers" not in log, said
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resume: {last} (torchrun restart 1: the newest last.ckpt of job" in log, log[-5000:]
    assert "--nnodes 1:2, 1 node(s) this round" in log, log[-5000:]
    (_, step0, first0), _ = beats(tmp_path, ranks=2)  # the restarted attempt's rank 0
    assert (first0 - 1) % BATCHES and step0 == EPOCHS * BATCHES, (killed, first0, step0)  # resumed mid-epoch
    folder = last.parent.parent  # the restarted group wrote into the first attempt's folder (last_of: the only one)
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one TensorBoard file per attempt, one version
    val_steps = [step for step, _ in tensorboard_scalars(folder)["val/acc1"]]
    assert val_steps == [BATCHES * e - 1 for e in range(1, EPOCHS + 1)], val_steps  # each epoch once, in order
    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id, [(r.path, r.run_id) for r in runs]
    steps = [row["trainer/global_step"] for row in runs[1].history if "trainer/global_step" in row]
    assert steps and min(steps) >= BATCHES, steps
    # the same job never interrupted (Lightning's launcher, no restarts): the same weights and, per step, the same
    # samples
    ours, theirs = last_of(tmp_path), last_of(uninterrupted)
    assert ours["global_step"] == EPOCHS * BATCHES
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in theirs["state_dict"].items()), "weights differ"
    for rank in (0, 1):
        assert per_step(tmp_path, rank) == per_step(uninterrupted, rank), rank
    print(f"\nrank 1 SIGKILLed at step {killed[1]}; resumed at step {first0}, ended at {step0}; W&B {runs[0].run_id}")
