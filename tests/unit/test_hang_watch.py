"""The hang watch's parts that need no second process: where a thread is, the NCCL flight recorder's settings, the
timeout the plan shows (the stuck ranks themselves: ``tests/distributed/test_hangs.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

from app.launch.preflight import build
from app.resilience.hang_watch import apply_flight_recorder, effective_timeout, where
from tests.conftest import ROOT, free_port
from tools.slurm import resolve_config

pytestmark = pytest.mark.xdist_group("timing")  # its pass depends on wall-clock limits: never beside another such test


def napping(started: threading.Event, done: threading.Event) -> None:
    started.set()
    while not done.is_set():
        time.sleep(0.01)


def test_where_names_the_innermost_python_frames_of_another_thread():
    started, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=napping, args=(started, done))
    thread.start()
    started.wait()
    try:
        frames = where(sys._current_frames()[thread.ident])
    finally:
        done.set()
        thread.join()
    assert frames[0].startswith("tests/unit/test_hang_watch.py:") and frames[0].endswith(" napping"), frames
    assert frames[1].endswith(" run") and len(frames) == 4, frames  # threading.Thread.run called it


def ddp(backend: str) -> DDPStrategy:
    strategy = DDPStrategy(
        process_group_backend=backend,
        parallel_devices=[torch.device("cpu")] * 2,
        cluster_environment=LightningEnvironment(),
    )
    strategy.set_world_ranks()
    return strategy


def test_nccl_jobs_get_the_flight_recorder_with_files_in_the_run_folder(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}  # the user's own value stays
    made = apply_flight_recorder(ddp("nccl"), tmp_path / "nccl_trace", environ)
    assert made == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "nccl_trace" / "nccl_trace_rank_"),
    }
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100" and made.items() <= environ.items()
    assert apply_flight_recorder(ddp("gloo"), tmp_path, {}) == {}  # nothing to record on gloo
    made = apply_flight_recorder(ddp("nccl"), tmp_path, environ := {})  # a small buffer, by the name torch reads
    assert made["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ, made


# a process of its own: the recorder's buffer is the process's, and collectives of the in-process tests before this
# one in the same worker (and a process group one of them left) would be in it
DUMP_JOB = """
import os, pickle, sys
from pathlib import Path
import torch, torch.distributed as dist
from app.resilience.hang_watch import dump_flight_recorder
out = Path(sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
assert dump_flight_recorder(out / "nccl_trace_rank_0") is None
print([e["profiling_name"] for e in pickle.loads((out / "nccl_trace_rank_0").read_bytes())["entries"]])
del torch._C._distributed_c10d._dump_fr_trace  # a torch that records NCCL only
print(dump_flight_recorder(out / "again"))
dist.destroy_process_group()
"""


def test_the_hang_watch_dumps_the_flight_recorder_or_says_why_not(tmp_path):
    """What a rank's watch writes on a hang (``dump_flight_recorder``): gloo's recorder in torch 2.14, in the format
    torchfrtrace reads; where torch has no dump for the backend, the reason rank 0's diagnosis says instead."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", DUMP_JOB, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    recorded, why = out.stdout.splitlines()[-2:]
    assert recorded == "['gloo:all_reduce']", out.stdout
    assert why == f"torch {torch.__version__} has no flight-recorder dump for gloo (a newer torch records gloo too)"
    assert not (tmp_path / "again").exists()


def test_the_hang_timeout_stays_inside_the_collective_timeout():
    assert effective_timeout(600, None) == 600 and effective_timeout(0, 60) == 0
    assert effective_timeout(600, 1800) == 600
    assert effective_timeout(600, 120) == 90 and effective_timeout(600, 20) == 10


def test_the_plan_shows_the_hang_watch_for_multi_process_runs_only():
    config = resolve_config(["fit", "--trainer.default_root_dir", str(Path("/tmp/plan-test"))])
    assert "hang watch" not in build(config, hang_timeout=600).render()  # one device, one process
    config = resolve_config(["fit", "--trainer.strategy", "ddp", "--trainer.devices", "2"])
    assert "hang watch   a rank without a finished step for 600 s is named" in build(config, hang_timeout=600).render()
    assert "hang watch   off (--launch.hang_timeout 0)" in build(config, hang_timeout=0).render()
