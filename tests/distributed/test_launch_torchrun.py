"""Launch paths without a cluster: ``torchrun ... cli.py fit`` (2 processes, gloo), and a node that never arrives."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_process_fit(mnist_dir, tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(ROOT / "cli.py"), "fit",
        "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "10", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false", "--data.data_dir", str(mnist_dir),
        "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert log.count("preflight plan") == 1 and "launcher     torchrun" in log, log[-4000:]
    assert "1 node(s) x 2 process(es) = world size 2" in log
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    (version,) = tmp_path.glob("version_*")  # one run folder, written by rank 0
    last = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 10


def test_a_node_that_never_arrives_fails_within_the_timeout_naming_it(mnist_dir, tmp_path):
    # Lightning's own multi-node launch (`python cli.py fit` on every node with MASTER_ADDR and NODE_RANK):
    # node 0 is started, node 1 never is.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    out = run_cli(
        "fit", "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.accelerator", "cpu",
        "--launch.timeout", "5", "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(tmp_path),
        env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "did not all meet within 5 s (--launch.timeout)" in out.stderr, out.stderr[-3000:]
    assert "only 1 of 2 arrived" in out.stderr and "node 1 ?: rank 1" in out.stderr
    assert not list(tmp_path.glob("version_*/checkpoints/*.ckpt"))
