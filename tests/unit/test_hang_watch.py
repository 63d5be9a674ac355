"""The hang watch's parts that need no second process: where a thread is, the NCCL flight recorder's settings, the
timeout the plan shows (the stuck ranks themselves: ``tests/distributed/test_hangs.py``)."""

from __future__ import annotations

import pickle
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

from app.launch.preflight import build
from app.resilience.hang_watch import apply_flight_recorder, dump_flight_recorder, effective_timeout, where
from tests.conftest import free_port
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


def test_the_hang_watch_dumps_the_flight_recorder_or_says_why_not(tmp_path, monkeypatch):
    """What a rank's watch writes on a hang (``dump_flight_recorder``): gloo's recorder in torch 2.14, in the format
    torchfrtrace reads; where torch has no dump for the backend, the reason rank 0's diagnosis says instead."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        assert dump_flight_recorder(tmp_path / "nccl_trace_rank_0") is None
        entries = pickle.loads((tmp_path / "nccl_trace_rank_0").read_bytes())["entries"]
        assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"], entries
        monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace")  # a torch that records NCCL only
        why = dump_flight_recorder(tmp_path / "again")
        assert why == f"torch {torch.__version__} has no flight-recorder dump for gloo (a newer torch records gloo too)"
        assert not (tmp_path / "again").exists()
    finally:
        dist.destroy_process_group()


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
