"""Launch paths without a cluster: ``torchrun ... cli.py fit`` (2 processes, gloo; and 2 nodes of 1 process each on
this machine), the deprecated ``python -m torch.distributed.launch`` (with and without ``--use-env``) and a node that
never arrives. An elastic job (``--nnodes 1:2``) whose worker is SIGKILLed: ``test_lightning_launcher_heals.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from datamodules.base import auto_workers, available_cpus
from tests.conftest import ROOT, free_port, port_taken, short_fit
from tests.troubleshooting import assert_documented

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("timing")]
PROBE = "tools.resume_probe.SampleLog"


def fit_args(mnist_dir, root, *extra: str) -> list[str]:
    return [str(ROOT / "cli.py"), "fit", *short_fit(root, mnist_dir, 10, 2), *extra]


def torchrun(*args: str, module: str = "torch.distributed.run") -> subprocess.Popen:
    command = [sys.executable, "-m", module, *args]
    return subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def one_run_folder_at_step(root, step: int) -> None:
    (version,) = root.glob("version_*")  # one run folder, written by rank 0
    last = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == step


def test_torchrun_two_process_fit(mnist_dir, tmp_path):
    # --standalone: torchrun picks a free port for its own rendezvous and binds it itself (no port chosen here)
    job = torchrun("--standalone", "--nproc_per_node", "2", *fit_args(mnist_dir, tmp_path, "--trainer.devices", "2"))
    log, _ = job.communicate(timeout=600)
    assert job.returncode == 0, log[-4000:]
    assert log.count("preflight plan") == 1 and "launcher     torchrun" in log, log[-4000:]
    assert "1 node(s) x 2 process(es) = world size 2" in log
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    one_run_folder_at_step(tmp_path, 10)


def legacy_launch(nproc: int, *args: str) -> tuple[subprocess.Popen, str, int]:
    """``python -m torch.distributed.launch --nproc_per_node N --master_port P ARGS``: its job, output and port."""
    for _attempt in range(3):  # as below: retried if another process took the port before the job bound it
        port = free_port()
        job = torchrun(
            "--nproc_per_node", str(nproc), "--master_port", str(port), *args, module="torch.distributed.launch"
        )
        log, _ = job.communicate(timeout=600)
        if not port_taken(log):
            break
    return job, log, port


def workers_line(processes: int) -> str:
    cpus = available_cpus()
    return (
        f"data.num_workers auto: {auto_workers(processes, cpus)} loader worker(s) per process ({cpus} CPUs on this node"
    )


def test_deprecated_torch_distributed_launch_trains_and_names_torchrun(mnist_dir, tmp_path):
    # it passes --local-rank=K to cli.py, which LightningCLI alone rejects
    args = fit_args(mnist_dir, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp")
    job, log, port = legacy_launch(2, *args, "--trainer.max_steps", "3", "--data.num_workers", "auto")
    assert job.returncode == 0, log[-4000:]
    assert "launcher     torchrun (started by python -m torch.distributed.launch, deprecated)" in log, log[-4000:]
    assert "1 node(s) x 2 process(es) = world size 2" in log
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    assert "note: python -m torch.distributed.launch is deprecated" in log
    same_job = (
        f"torchrun --nproc_per_node 2 --master_port {port} {ROOT / 'cli.py'} fit --trainer.default_root_dir {tmp_path}"
    )
    assert f"The same job with torchrun: {same_job}" in log
    assert f"{workers_line(2)} // 2 training process(es)" in log  # the node's CPUs shared by the launcher's 2
    one_run_folder_at_step(tmp_path, 3)


def test_deprecated_launch_with_use_env_is_recognised_too(mnist_dir, tmp_path):
    # --use-env: no --local-rank flag, the same variables as torchrun; the launcher's command line tells
    args = fit_args(mnist_dir, tmp_path, "--trainer.max_steps", "1", "--data.num_workers", "auto")
    job, log, port = legacy_launch(1, "--use-env", *args)
    assert job.returncode == 0, log[-4000:]
    assert f"{workers_line(1)} // 1 training process(es)" in log
    assert f"The same job with torchrun: torchrun --nproc_per_node 1 --master_port {port} {ROOT / 'cli.py'}" in log
    one_run_folder_at_step(tmp_path, 1)


def test_torchrun_two_nodes_one_process_each(mnist_dir, tmp_path):
    """``torchrun --nnodes 2 --node_rank R`` on each "node" (here both on localhost), meeting at node 0's address."""
    args = fit_args(mnist_dir, tmp_path, "--trainer.devices", "1", "--trainer.num_nodes", "2")
    for _attempt in range(3):  # the port is checked free, but another process may bind it before node 0 does
        port = free_port()
        common = ["--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        nodes = [torchrun(*common, "--node_rank", str(rank), *args) for rank in (0, 1)]
        try:
            logs = [nodes[0].communicate(timeout=600)[0]]
            if port_taken(logs[0]):  # node 0 could not host the rendezvous: node 1 would wait for it in vain
                nodes[1].kill()
            logs.append(nodes[1].communicate(timeout=600)[0])
        finally:
            for node in nodes:
                node.kill()
        if not port_taken(logs[0]):
            break
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "launcher     torchrun" in logs[0] and "2 node(s) x 1 process(es) = world size 2" in logs[0], logs[0]
    assert "preflight plan" not in logs[1]  # printed once, by global rank 0
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    one_run_folder_at_step(tmp_path, 10)


def test_a_node_that_never_arrives_fails_within_the_timeout_naming_it(mnist_dir, tmp_path):
    # Lightning's own multi-node launch (`python cli.py fit` on every node with MASTER_ADDR and NODE_RANK):
    # node 0 is started, node 1 never is.
    args = fit_args(mnist_dir, tmp_path, "--trainer.num_nodes", "2", "--trainer.devices", "1", "--launch.timeout", "5")
    for _attempt in range(3):  # as above: retried if the port was taken in between
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0", "PYTHONUNBUFFERED": "1"}
        job = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        lines, waiting_since = [], None
        for line in job.stdout:  # the moment rank 0 starts waiting for the others at the rendezvous
            lines.append(line)
            if waiting_since is None and "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in line:
                waiting_since = time.monotonic()
        job.wait(timeout=60)
        waited = time.monotonic() - (waiting_since or time.monotonic())
        out = "".join(lines)
        if not port_taken(out):
            break
    assert job.returncode == 1 and waiting_since is not None, out[-3000:]
    assert "did not all meet within 5 s (--launch.timeout)" in out, out[-3000:]
    assert_documented(out, "rendezvous-timeout")
    assert "only 1 of 2 arrived" in out and "node 1 ?: rank 1" in out
    assert "Traceback" not in out, out[-3000:]
    # it waited for the timeout it was given, and then no longer: not the 1800 s default, not a hang
    assert 5 <= waited < 5 + 25, f"rank 0 gave up {waited:.1f} s after it started waiting (--launch.timeout 5)"
    assert not list(tmp_path.glob("version_*/checkpoints/*.ckpt"))
