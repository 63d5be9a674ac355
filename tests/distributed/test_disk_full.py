"""A full disk during a checkpoint save, on a real small filesystem (a 16 MB tmpfs the test mounts as the run folder),
in a 2-process ``ddp`` fit through ``cli.py``: the preflight warns that the folder holds fewer than three checkpoints;
the second ``last.ckpt`` (mnist_cnn with SGD and momentum: 9.6 MB, twice that while the atomic save runs) does not
fit, and every rank stops with the same one line (space needed and free, the previous checkpoint and its step kept),
without a traceback and without one rank reporting the other as lost; the previous ``last.ckpt`` still loads.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.conftest import run_cli
from tests.troubleshooting import assert_documented


@pytest.mark.slow
@pytest.mark.distributed
def test_disk_full_during_a_save_stops_every_rank_in_one_line_and_keeps_the_previous_checkpoint(mnist_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting the small tmpfs this test fills needs root (mount -t tmpfs)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = run_cli(
            "fit", "--config", "configs/mnist_2epochs.yaml",  # SGD: the checkpoint sizes below are its (Adam's: 1.5x)
            "--trainer.default_root_dir", str(disk), "--data.data_dir", str(mnist_dir),
            "--data.batch_size", "8", "--data.num_workers", "0", "--model.arch", "mnist_cnn",
            "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--launch.timeout", "120",
            # only last.ckpt, every 2 steps: step 2 fits, step 4 finds the disk full
            "--checkpoint.every_n_train_steps", "2", "--checkpoint.monitor", "null", "--checkpoint.save_top_k", "0",
            timeout=300,
        )  # fmt: skip
        said = out.stdout + out.stderr
        assert out.returncode == 1, said[-3000:]
        warnings = [line for line in said.splitlines() if line.startswith(f"warning: preflight: {disk} has ")]
        assert len(warnings) == 1 and "room for 1.7 checkpoints of about 9.6 MB" in warnings[0], said[-3000:]
        last = disk / "version_0" / "checkpoints" / "last.ckpt"
        line = assert_documented(said, "disk-full", ranks=2)
        assert f"the checkpoint {last} failed" in line and "it needs about 9.6 MB and " in line, line
        assert f"the previous {last} (global step 2) is intact" in line, line
        for noise in ("Traceback", "lost rank", "unexpected pos", "Errno 28"):
            assert noise not in said, said[-3000:]
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 2
        assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]  # no partial file
    finally:
        subprocess.run(["umount", str(disk)], check=True)
