"""The hang watch's parts that need no second process: where a thread is, the NCCL flight recorder's settings, the
timeout the plan shows (the stuck ranks themselves: ``tests/distributed/test_hangs.py``)."""

from __future__ import annotations

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
