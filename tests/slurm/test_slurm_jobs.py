"""Real jobs on the throwaway SLURM cluster, submitted the way a user does: ``python -m tools.slurm submit``."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from app.callbacks import SLURMRequeue
from tests.slurm.conftest import ROOT, free_port, job_info, skip_or_fail, submit, wait_job
from tests.wandb_reader import offline_runs, requires_wandb
from tools.resume_probe import per_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("timing")]

EPOCHS, BATCHES = 2, 50  # 100 steps: each attempt of the requeue jobs pays its start-up anyway
# (of 32 images per rank: the steps place the faults; the default 256 would only make each attempt longer)
HOLD = BATCHES + 20  # the step of the second epoch at which the SIGUSR1 job waits for the signal
HOLD_CALLBACK = "tests.slurm.test_slurm_jobs.HoldUntilSignalled"


class HoldUntilSignalled(Callback):
    """At global step ``HOLD`` every rank says so (``<root>/held/rank<R>``) and waits, up to 300 s, until the app's
    ``SLURMRequeue`` has received the SIGUSR1 the test then sends: the signal lands mid-training, never after it."""

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != HOLD:
            return
        (requeue,) = [c for c in trainer.callbacks if isinstance(c, SLURMRequeue)]
        folder = Path(trainer.default_root_dir) / "held"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{trainer.global_rank}").write_text(str(trainer.global_step))
        deadline = time.monotonic() + 300
        while not requeue._requested and time.monotonic() < deadline:
            time.sleep(0.05)


def fit_args(mnist_dir: Path, root: Path, epochs: int = EPOCHS, batches: int = BATCHES) -> list[str]:
    return [
        "fit", "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(root),
        "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", str(batches),
        "--trainer.limit_val_batches", "5", "--trainer.enable_progress_bar", "false", "--data.batch_size", "32",
        "--trainer.callbacks+=tools.resume_probe.SampleLog", f"--trainer.callbacks.folder={root}",
    ]  # fmt: skip


def final_step(root: Path) -> int:
    """The global step of the run's ``last.ckpt``; asserts the job left exactly one run folder."""
    versions = sorted(root.glob("version_*"))
    assert len(versions) == 1, f"expected one run folder in {root}, found {versions}"
    return torch.load(versions[0] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def last_weights(root: Path) -> dict:
    (last,) = root.glob("version_*/checkpoints/last.ckpt")
    return torch.load(last, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(slurm_env, mnist_dir, tmp_path_factory):
    """A 2-task CPU DDP fit on one node, submitted by the app and left alone: (root, log, job info)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    job = submit(slurm_env, "--tasks-per-node", "2", "--time", "10:00", "--", *fit_args(mnist_dir, root))
    info = wait_job(slurm_env, job)
    return root, (root / f"slurm-{job}.out").read_text(), info


def test_submitted_2_task_ddp_fit_completes_with_one_set_of_outputs(uninterrupted):
    root, log, info = uninterrupted
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log, log[-3000:]
    assert log.count("preflight plan") == 1 and "launcher     SLURM" in log  # printed by rank 0 only
    assert final_step(root) == EPOCHS * BATCHES
    assert len(list(root.glob("version_0/events.out.tfevents.*"))) == 1  # one logger (rank 0)
    assert len(list(root.glob("sbatch/*.sh"))) == 1  # the script that ran is kept with the run


def test_two_nodes_one_task_each(slurm_env, slurm_nodes, mnist_dir, tmp_path):
    if slurm_nodes < 2:
        skip_or_fail("the cluster has one node: start it with SLURM_CI_NODES=2 (the default of tools/slurm_cluster.sh)")
    args = fit_args(mnist_dir, tmp_path, epochs=1, batches=10)
    job = submit(slurm_env, "--nodes", "2", "--tasks-per-node", "1", "--time", "10:00", "--", *args)
    info = wait_job(slurm_env, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["NumNodes"] == "2"
    assert "2 node(s) x 1 process(es) = world size 2" in log
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    assert final_step(tmp_path) == 10


@requires_wandb
def test_sigusr1_checkpoints_requeues_and_resumes_to_the_same_step(slurm_env, mnist_dir, tmp_path, uninterrupted):
    # with W&B on (offline, as on a compute node without network): the requeued attempt must continue the same run
    env = {**{k: v for k, v in slurm_env.items() if not k.startswith("WANDB_")}, "WANDB_MODE": "offline"}
    wandb_config = ["--config", str(ROOT / "configs" / "logger" / "wandb.yaml")]
    args = [*fit_args(mnist_dir, tmp_path), f"--trainer.callbacks+={HOLD_CALLBACK}"]
    job = submit(env, "--tasks-per-node", "2", "--time", "10:00", "--", *args[:1], *wandb_config, *args[1:])
    # both ranks wait at step HOLD (after the first epoch's checkpoint) until the signal has reached them
    deadline = time.monotonic() + 400
    while not all((tmp_path / "held" / f"rank{r}").is_file() for r in (0, 1)):
        state = job_info(slurm_env, job).get("JobState")
        output = tmp_path / f"slurm-{job}.out"
        assert state in ("PENDING", "RUNNING"), (state, output.read_text()[-3000:] if output.is_file() else "no log")
        assert time.monotonic() < deadline, f"the job never reached step {HOLD}"
        time.sleep(0.2)
    assert list(tmp_path.glob("version_*/checkpoints/last.ckpt"))  # the first epoch's checkpoint is there
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True)
    info = wait_job(slurm_env, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["Restarts"] == "1", info
    assert "Handling auto-requeue signal" in log and "attempt 2" in log, log[-3000:]
    assert "Restored all states from the checkpoint" in log and (tmp_path / "hpc_ckpt_1.ckpt").is_file(), log[-3000:]
    # the requeued attempt's plan names what it resumes from: the hpc_ckpt of the signal, or the last.ckpt the requeue's
    # SIGTERM saved at the next step boundary when that is newer (the same run, a step further)
    assert "resume from  hpc: " in log or "(SLURM requeue 1: the newest checkpoint of job" in log, log[-3000:]
    uninterrupted_root = uninterrupted[0]
    assert final_step(tmp_path) == final_step(uninterrupted_root) == EPOCHS * BATCHES  # same run folder, same end
    # requeued mid-epoch (epoch 1, batch 20), it ends exactly as the uninterrupted job: the same weights bit for
    # bit, and every rank trained the same samples at each step (a step trained again after the requeue counts once)
    ours, theirs = (last_weights(root) for root in (tmp_path, uninterrupted_root))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "the requeued job's weights differ"
    for rank in (0, 1):
        assert per_step(tmp_path, rank) == per_step(uninterrupted_root, rank), rank
    runs = offline_runs(tmp_path)
    assert len(runs) == 2, [r.path for r in runs]  # one offline folder per attempt, rank 0 only
    assert runs[0].run_id == runs[1].run_id, [r.run_id for r in runs]  # the requeued attempt continues the W&B run


def test_tasks_per_node_not_matching_devices_fails_fast_with_the_fix(slurm_env, tmp_path):
    command = [
        "srun", "--nodes=1", "--ntasks-per-node=2", "--time=5", sys.executable, str(ROOT / "cli.py"), "fit",
        "--trainer.devices", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(command, cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "preflight" in out.stderr and "--ntasks-per-node 2" in out.stderr, out.stderr[-3000:]
    assert "Fix: `--trainer.devices 2`" in out.stderr
    assert not list(tmp_path.glob("version_*"))  # nothing was started


def test_preemptions_leave_the_fault_budget_whole_and_two_faults_each_requeue_the_job(
    slurm_env, mnist_dir, tmp_path, uninterrupted
):
    """``--launch.max_restarts 2``: three requeues by preemption (``scontrol requeue`` from outside, each as an attempt
    starts), then one fault per attempt, both on rank 1: SIGKILLed as it reads its configuration, before the process
    group forms (attempt 3); its DataLoader worker SIGKILLed mid-epoch 2 (4), found when the batches already loaded
    are used up. The preemptions use none of the budget; each failed step is recorded in the run folder and requeues
    the job (``scontrol requeue`` by the batch script), each requeued attempt resumes its newest checkpoint, and the
    sixth ends with the uninterrupted job's weights and samples, in one run folder. (A rank asleep or SIGKILLed
    mid-epoch fails the step as these do; with the app requeueing: the next test, which also has the hang.)"""
    probe = "--trainer.callbacks+=tools.resume_probe."
    faults = [f"{probe}DieStarting", "--trainer.callbacks.attempt", "3"]
    faults += [f"{probe}KillLoaderWorkerAt", "--trainer.callbacks.step", str(HOLD), "--trainer.callbacks.attempt", "4"]
    args = [*fit_args(mnist_dir, tmp_path), *faults, "--launch.max_restarts", "2"]
    args += ["--checkpoint.every_n_train_steps", "20", "--data.num_workers", "1"]
    job = submit(slurm_env, "--tasks-per-node", "2", "--time", "10:00", "--", *args)
    requeue_from_outside(slurm_env, job, tmp_path / f"slurm-{job}.out", times=3)
    info = wait_job(slurm_env, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "5", (info, log[-4000:])
    assert log.count("SLURM: the job step failed (exit ") == 2, log[-4000:]
    for fault, attempt in ((1, 4), (2, 5)):
        said = f"fault {fault} of 2; 3 requeues by time or preemption before it; requeue {attempt}:"
        assert said in log, log[-4000:]
    assert "error: rank 1 (host n1): its DataLoader worker (pid " in log, log[-4000:]  # n1: the only node
    # rank 1 SIGKILLed starting could record nothing (the script did); the lost worker, the app
    records = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(r["job"], r["attempt"], r["kind"]) for r in records] == [
        (job, 4, "step-failed"), (job, 5, "loader-worker-lost")
    ], records  # fmt: skip
    # requeue 4 started from scratch (nothing was saved before rank 1 died starting), requeue 5 resumes
    assert "(SLURM requeue 5: the newest checkpoint of job " in log, log[-4000:]
    uninterrupted_root = uninterrupted[0]
    assert final_step(tmp_path) == final_step(uninterrupted_root) == EPOCHS * BATCHES
    ours, theirs = (last_weights(root) for root in (tmp_path, uninterrupted_root))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "the requeued job's weights differ"
    for rank in (0, 1):
        assert per_step(tmp_path, rank) == per_step(uninterrupted_root, rank), rank


def test_your_own_sbatch_script_with_requeue_is_requeued_by_the_app_after_each_fault(
    slurm_env, mnist_dir, tmp_path, uninterrupted
):
    """A batch script of the user's own (``#SBATCH --requeue``, a plain ``srun python cli.py fit ...
    --launch.max_restarts 3``, no requeue logic of its own), one fault per attempt on rank 1: SIGKILLed as it starts
    (rank 0 waits ``--launch.timeout`` at the rendezvous, then says who is missing), asleep mid-epoch 2 (the hang
    watch ends the step), SIGKILLed later in epoch 2 (the survivor names the lost rank). Each time the app requeues the
    job (``scontrol requeue``, one line); the fourth attempt resumes its newest checkpoint and ends as the
    uninterrupted job, bit for bit, in one run folder."""
    probe = "--trainer.callbacks+=tools.resume_probe."
    args = [*fit_args(mnist_dir, tmp_path), f"{probe}DieStarting", "--trainer.callbacks.attempt", "0"]
    args += [f"{probe}HangAt", "--trainer.callbacks.step", "75", "--trainer.callbacks.attempt", "1"]
    args += [f"{probe}SignalAt", "--trainer.callbacks.step", "85", "--trainer.callbacks.rank", "1"]
    args += ["--trainer.callbacks.sigkill", "true", "--trainer.callbacks.attempt", "2"]
    args += ["--launch.max_restarts", "3", "--launch.hang_timeout", "10", "--launch.timeout", "30"]
    args += ["--checkpoint.every_n_train_steps", "20", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    script = tmp_path / "mine.sh"
    script.write_text(
        "\n".join([
            "#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=10:00",
            "#SBATCH --requeue", "#SBATCH --open-mode=append", f"#SBATCH --output={tmp_path}/mine-%j.out",
            f"#SBATCH --chdir={ROOT}", f"srun {shlex.join([sys.executable, str(ROOT / 'cli.py'), *args])}", "",
        ])
    )  # fmt: skip
    env = {**slurm_env, "MASTER_PORT": str(free_port())}
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    info = wait_job(slurm_env, job)
    log = (tmp_path / f"mine-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "3", (info, log[-4000:])
    assert "error: the ranks did not all meet within 30 s (--launch.timeout): rank 0 waited" in log, log[-4000:]
    assert "error: hang watch: rank 1 of 2 is stuck" in log, log[-4000:]
    assert "error: lost rank 1 of 2 (on n1: no answer" in log, log[-4000:]  # the node to --exclude
    requeued = [line for line in log.splitlines() if line.startswith("SLURM: requeue ")]
    assert requeued == [
        f"SLURM: requeue {n} (scontrol requeue {job}): fault {n} of 3 (--launch.max_restarts); 0 requeues by time or "
        "preemption before it. The job goes back in the queue and resumes from its newest checkpoint. The line above "
        "names the node of the fault; keep the job off it with sbatch --exclude NODE."
        for n in (1, 2, 3)
    ], log[-4000:]
    for n in (2, 3):  # requeue 1 started from scratch: nothing was saved when rank 1 died starting
        assert f"(SLURM requeue {n}: the newest checkpoint of job {job})" in log, log[-4000:]
    uninterrupted_root = uninterrupted[0]
    assert final_step(tmp_path) == EPOCHS * BATCHES
    ours, theirs = (last_weights(root) for root in (tmp_path, uninterrupted_root))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "the requeued job's weights differ"
    for rank in (0, 1):
        assert per_step(tmp_path, rank) == per_step(uninterrupted_root, rank), rank


def requeue_from_outside(slurm_env: dict[str, str], job: str, log: Path, times: int) -> None:
    """``scontrol requeue JOB`` as a preemption does, ``times`` times: each as soon as an attempt has started."""
    deadline = time.monotonic() + 300
    for attempt in range(1, times + 1):
        while f"job {job} attempt {attempt} on" not in (log.read_text() if log.is_file() else ""):
            assert time.monotonic() < deadline, (attempt, job_info(slurm_env, job))
            time.sleep(0.2)
        subprocess.run(["scontrol", "requeue", job], env=slurm_env, check=True, capture_output=True)
