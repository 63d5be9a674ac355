"""Several multi-process jobs started at the same moment on one machine (two users on a shared node, a test suite on
two workers) never take each other's rendezvous port: each holds its own from its plan until it ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

JOBS = 3


@pytest.mark.slow
@pytest.mark.distributed
def test_jobs_started_at_once_each_meet_on_their_own_port(mnist_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    common = [
        "fit", "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--data.data_dir", str(mnist_dir),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    ]  # fmt: skip
    jobs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "cli.py"), *common, "--trainer.default_root_dir", str(tmp_path / f"job{i}")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(JOBS)
    ]
    logs = [job.communicate(timeout=600)[0] for job in jobs]
    for job, log in zip(jobs, logs, strict=True):
        assert job.returncode == 0, log[-3000:]
    ports = [re.search(r"rendezvous: port (\d+) of this host", log) for log in logs]
    assert all(ports), logs[0][-3000:]
    assert len({p.group(1) for p in ports}) == JOBS  # three ports, one per job, none shared
