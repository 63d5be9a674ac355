"""A job killed mid-training and resumed continues the same W&B run and TensorBoard version; no secret leaks.

The first run has no W&B credentials (empty HOME), so it goes offline by itself; it is SIGKILLed (no clean
shutdown) as soon as it has written a checkpoint (Lightning writes them atomically: a file that exists is complete).
The resumed run (``--ckpt_path last``) has a (fake) API key and ``WANDB_MODE=offline``: the key must appear in no
file the job wrote and in none of its output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace

from app.checkpoint import Checkpoints, From, RunIdentity
from app.loggers import prepare_loggers
from core.env import detect
from tests.conftest import ROOT
from tests.wandb_reader import offline_runs, requires_wandb, tensorboard_scalars

FAKE_KEY = "fake0key" + "5" * 32  # 40 characters, the shape of a real W&B API key


def save_with_identity(path: Path, identity: RunIdentity) -> None:
    """A (tiny) checkpoint holding only a run identity, as the app writes it."""
    checkpoint: dict = {}
    identity.save_in(checkpoint)
    torch.save(checkpoint, path)


def _cli(args: list[str], env: dict, cwd: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env, text=True, **popen
    )  # fmt: skip


@pytest.mark.slow
@requires_wandb
def test_killed_job_resumes_the_same_wandb_run_and_tensorboard_version_without_leaking_the_key(mnist_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    root = tmp_path / "run"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    base_env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    # fmt: off
    common = [
        "fit", "--config", str(ROOT / "configs" / "logger" / "wandb.yaml"), "--trainer.default_root_dir", str(root),
        "--data.data_dir", str(mnist_dir), "--trainer.limit_train_batches", "20", "--trainer.limit_val_batches", "2",
        "--trainer.log_every_n_steps", "10", "--trainer.enable_progress_bar", "false",
    ]
    # fmt: on

    # 1. no credentials: offline by itself; killed without warning once a checkpoint exists
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    log1 = (tmp_path / "first.log").open("w")
    first = _cli([*common, "--trainer.max_epochs", "1000"], base_env, tmp_path, stdout=log1, stderr=subprocess.STDOUT,
                 start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 400
    while not last.is_file() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the whole session: wandb's service process dies with the job
    first.wait(timeout=60)
    log1.close()
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    assert last.is_file(), (tmp_path / "first.log").read_text()[-3000:]
    saved = torch.load(last, map_location="cpu", weights_only=False)
    (killed_run,) = offline_runs(tmp_path)
    identity = RunIdentity.of(saved).as_dict()
    config = yaml.safe_load(identity.pop("config"))  # the run's configuration, which a resume compares with its own
    assert identity == {"tensorboard_version": "version_0", "wandb_id": killed_run.run_id}
    assert config["trainer"]["max_epochs"] == 1000, config["trainer"]

    # 2. resume with a fake key, offline: same W&B run id, same TensorBoard version, training continues
    env = {**base_env, "WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "offline"}
    max_epochs = str(saved["epoch"] + 2)
    second = _cli([*common, "--trainer.max_epochs", max_epochs, "--ckpt_path", "last"], env, tmp_path,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, (out[-2000:], err[-4000:])

    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and {r.run_id for r in runs} == {killed_run.run_id}, [(r.path, r.run_id) for r in runs]
    resumed = runs[-1]
    assert resumed.path != killed_run.path, [r.path for r in runs]  # the second folder is the resumed run's
    steps = [row["trainer/global_step"] for row in resumed.history if "trainer/global_step" in row]
    assert steps and min(steps) >= saved["global_step"], (steps, saved["global_step"])  # continues, not from 0
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0"]
    val_steps = [step for step, _ in tensorboard_scalars(root / "version_0")["val/acc1"]]
    assert len(val_steps) >= saved["epoch"] + 2 and val_steps[-1] > saved["global_step"], val_steps

    # 3. the key is nowhere: not in the config, hyperparameters, checkpoints, W&B files, logs or output
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaks and FAKE_KEY not in out + err, leaks


def test_requeued_slurm_job_continues_the_run_of_its_hpc_checkpoint(tmp_path):
    """SLURM requeue resumes from ``<root>/hpc_ckpt_N.ckpt`` (Lightning picks the newest); the loggers follow it."""
    root = tmp_path / "run"
    root.mkdir()
    save_with_identity(root / "hpc_ckpt_2.ckpt", RunIdentity(tensorboard_version="version_3", wandb_id="abc123xy"))
    save_with_identity(root / "hpc_ckpt_1.ckpt", RunIdentity(wandb_id="older"))

    def config(ckpt_path, default_root_dir=root):
        loggers = [
            Namespace(class_path="app.loggers.TensorBoardLogger", init_args=Namespace(version=None)),
            Namespace(class_path="app.loggers.WandbLogger", init_args=Namespace(id=None, group=None)),
        ]
        trainer = Namespace(logger=loggers, num_nodes=1, default_root_dir=str(default_root_dir))
        return Namespace(trainer=trainer, ckpt_path=ckpt_path)

    requeued = config("hpc")
    prepare_loggers(requeued, "fit", Checkpoints.of(requeued).decide("hpc", "fit", detect({})))
    tb, wb = requeued.trainer.logger
    assert (tb.init_args.version, wb.init_args.id) == ("version_3", "abc123xy")

    # a checkpoint from another experiment's folder starts a new run (fine-tuning is not resuming that run)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(root / "hpc_ckpt_2.ckpt", other / "weights.ckpt")
    fresh = config(str(other / "weights.ckpt"))
    prepare_loggers(fresh, "fit", Checkpoints.of(fresh).decide(fresh.ckpt_path, "fit", detect({})))
    assert [lg.init_args.get("version", lg.init_args.get("id")) for lg in fresh.trainer.logger] == [None, None]


def test_restarted_torchrun_job_resumes_the_newest_last_checkpoint_of_its_own_job(tmp_path):
    """torchrun restarts the worker group: ``fit`` resumes the newest ``last.ckpt`` whose identity names this job
    (``TORCHELASTIC_RUN_ID``), never another job's newer one, also when it started from ``--ckpt_path FILE``."""
    root = tmp_path / "run"
    saved = {"version_0": "job-a", "version_1": "job-b", "version_2": "job-a", "version_3": "none"}
    for version, job in saved.items():  # written in this order: version_3 is the newest file
        (root / version / "checkpoints").mkdir(parents=True)
        identity = RunIdentity(tensorboard_version=version, wandb_id=f"w{version[-1]}", torchrun_job=job)
        save_with_identity(root / version / "checkpoints" / "last.ckpt", identity)
        time.sleep(0.01)  # distinct modification times

    def config(ckpt_path=None):
        loggers = [
            Namespace(class_path="app.loggers.TensorBoardLogger", init_args=Namespace(version=None)),
            Namespace(class_path="app.loggers.WandbLogger", init_args=Namespace(id=None, group=None)),
        ]
        trainer = Namespace(logger=loggers, num_nodes=1, default_root_dir=str(root))
        return Namespace(trainer=trainer, ckpt_path=ckpt_path)

    def launch(job, restart):
        return detect({"TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_RESTART_COUNT": str(restart), "WORLD_SIZE": "2"})

    def decision(cfg, subcommand, launch):
        return Checkpoints.of(cfg).apply(cfg, subcommand, launch)

    def resume_torchrun_job(cfg, subcommand, launch):  # the file the resume decision picked for a torchrun restart
        found = decision(cfg, subcommand, launch)
        return found.path if found.source is From.TORCHRUN else None

    restarted = config()
    found = decision(restarted, "fit", launch("job-a", 1))
    assert found.path == root / "version_2/checkpoints/last.ckpt"
    prepare_loggers(restarted, "fit", found)
    tb, wb = restarted.trainer.logger
    assert (restarted.ckpt_path, tb.init_args.version, wb.init_args.id) == (
        str(root / "version_2/checkpoints/last.ckpt"),
        "version_2",
        "w2",
    )
    assert resume_torchrun_job(config(), "fit", launch("job-c", 1)) is None  # nothing of this job: a fresh start
    # --ckpt_path FILE names where the job starts: its first attempt loads FILE, a restart continues its own newer save
    assert decision(config("given.ckpt"), "fit", launch("job-a", 0)).source is From.FILE
    own = root / "version_2/checkpoints/last.ckpt"
    assert resume_torchrun_job(config("given.ckpt"), "fit", launch("job-a", 1)) == own
    assert decision(config("given.ckpt"), "fit", launch("job-c", 1)).source is From.FILE  # nothing of its own yet
    # torchrun's default --rdzv-id is "none" for every job: only a restart of it resumes
    assert resume_torchrun_job(config(), "fit", launch("none", 0)) is None
    assert resume_torchrun_job(config(), "fit", launch("none", 1)) == root / "version_3/checkpoints/last.ckpt"
    assert resume_torchrun_job(config(), "validate", launch("job-a", 1)) is None
