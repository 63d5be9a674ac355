"""A 2-process DDP fit on CPU (gloo) with TensorBoard + W&B, as a user without a W&B account runs it.

One job checks what the user sees: exactly one W&B run (offline, by itself, with one line on how to sync it),
recording the training/validation/throughput metrics, the learning rate, the resolved config, the environment and
the best checkpoint as an artifact;
one TensorBoard version with the same scalars; and the run identity kept in the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from app.checkpoint import RunIdentity
from tests.conftest import ROOT
from tests.wandb_reader import offline_runs, requires_wandb, tensorboard_scalars

WANDB_CONFIG = ROOT / "configs" / "logger" / "wandb.yaml"
METRICS = {
    "train/loss", "train/acc1", "train/acc5", "train/loss_epoch", "train/acc1_epoch", "train/acc5_epoch",
    "val/loss", "val/acc1", "val/acc5", "lr-Adam",
}  # fmt: skip
PERF = {"perf/images_per_sec", "perf/images_per_sec_per_device", "perf/data_time_frac", "perf/val_images_per_sec"}


@pytest.fixture(scope="module")
def ddp_job(mnist_dir, tmp_path_factory) -> tuple[Path, object]:
    """The job: 2 CPU processes, 2 epochs of 12 batches, no W&B credentials anywhere (empty HOME)."""
    work = tmp_path_factory.mktemp("ddp_tracking")
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    root = work / "run"
    # the shipped W&B config, plus the optional model artifact
    config = yaml.safe_load(WANDB_CONFIG.read_text())
    config["trainer"]["logger"][1]["init_args"]["log_model"] = True
    (work / "wandb_artifact.yaml").write_text(yaml.safe_dump(config))
    # fmt: off
    args = [
        "fit", "--config", str(work / "wandb_artifact.yaml"), "--trainer.default_root_dir", str(root),
        "--data.data_dir", str(mnist_dir), "--data.batch_size", "32",
        "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "3",
        "--trainer.log_every_n_steps", "4", "--trainer.enable_progress_bar", "false",
    ]
    # fmt: on
    # cwd = the job's folder: a rank that created a stray ./wandb would show up below it
    proc = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return work, proc


@pytest.mark.slow
@pytest.mark.distributed
@requires_wandb
def test_one_offline_wandb_run_per_ddp_job_with_metrics_config_and_environment(ddp_job):
    work, proc = ddp_job
    run_files = sorted(work.rglob("run-*.wandb"))
    assert len(run_files) == 1, f"expected one W&B run for the 2-process job, found {run_files}"
    (run,) = offline_runs(work)
    # offline by itself (no key, no login), and said so once, with the command to upload it
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("W&B: offline")]
    assert len(lines) == 1 and "no W&B API key or login found" in lines[0], lines
    assert lines[0].endswith(f"wandb sync {run.path.parent}"), lines[0]

    missing = (METRICS | PERF | {"trainer/global_step", "epoch"}) - run.keys
    assert not missing, f"not in the W&B history: {sorted(missing)}; found {sorted(run.keys)}"
    steps = [row["trainer/global_step"] for row in run.history if "val/acc1" in row]
    assert len(steps) == 2 and steps[-1] == 2 * 12 - 1, steps  # one validation per epoch, global steps 0..23

    # the resolved config and the environment are the run's hyperparameters
    assert run.config["trainer"]["max_epochs"] == 2 and run.config["data"]["init_args"]["batch_size"] == 32
    env = run.config["env"]
    assert (env["world_size"], env["num_nodes"], env["strategy"]) == (2, 1, "DDPStrategy"), env
    assert env["precision"] == "32-true" and env["torch"] == torch.__version__ and env["device_names"]
    assert run.project == "dptrain" and run.group == ""  # one node: no group
    # log_model: true -> the best checkpoint is kept as a model artifact, uploaded by `wandb sync`
    assert any(a["type"] == "model" and "best" in a["aliases"] for a in run.artifacts), run.artifacts


@pytest.mark.slow
@pytest.mark.distributed
@requires_wandb
def test_ddp_job_writes_one_tensorboard_version_and_records_its_identity(ddp_job):
    work, _ = ddp_job
    root = work / "run"
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0"]
    scalars = tensorboard_scalars(root / "version_0")
    missing = (METRICS | PERF) - scalars.keys()
    assert not missing, f"not in the TensorBoard events: {sorted(missing)}; found {sorted(scalars)}"
    assert len(scalars["val/acc1"]) == 2 and 0.1 < scalars["val/acc1"][-1][1] <= 1.0
    ckpt = torch.load(root / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    (run,) = offline_runs(work)
    identity = RunIdentity.of(ckpt).as_dict()
    assert "trainer:" in identity.pop("config")  # the run's configuration (a resume compares its own with it)
    assert identity == {"tensorboard_version": "version_0", "wandb_id": run.run_id}
