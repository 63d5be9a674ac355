"""Resuming as a user does after something went wrong, with real runs of ``cli.py fit`` on real MNIST.

- The newest ``last.ckpt`` is truncated (a disk fault): ``--ckpt_path last`` falls back to the newest checkpoint that
  reads, says so in one line naming both, keeps the bad file, and the run ends with the same weights as one that was
  never interrupted.
- The learning rate is changed on resume: the restored optimizer takes it, and the run says what differs from the
  checkpoint's run in one block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_cli, short_fit

RECIPE = ["--config", str(ROOT / "configs" / "mnist_2epochs.yaml")]  # SGD lr 0.1 with a per-step schedule


def fit(root: Path, mnist_dir: Path, steps: int, *extra: str):
    args = [*RECIPE, *short_fit(root, mnist_dir, 8, 1, batch_size=16), "--trainer.max_steps", str(steps)]
    done = run_cli("fit", *args, "--checkpoint.every_n_train_steps", "2", *extra)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def last_of(root: Path) -> Path:
    return root / "version_0" / "checkpoints" / "last.ckpt"


def state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_a_damaged_last_checkpoint_falls_back_to_the_one_before_and_ends_as_if_nothing_happened(mnist_dir, tmp_path):
    """One byte of the newest checkpoint flipped on disk: torch alone would load it, damaged weights and all; its
    SHA-256 no longer matches, so the resume takes the one before. (A truncated file without a checksum:
    tests/unit/test_checkpoint_resume.py.)"""
    root = tmp_path / "run"
    fit(root, mnist_dir, 4)  # saves at steps 2 and 4: last.ckpt (4) keeps the one before as last.previous.ckpt (2)
    last, previous = last_of(root), last_of(root).with_name("last.previous.ckpt")
    assert (state(last)["global_step"], state(previous)["global_step"]) == (4, 2)
    damaged = bytearray(last.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # a silent disk fault in the middle of the weights
    last.write_bytes(bytes(damaged))
    assert state(last)["global_step"] == 4  # it still loads

    out = fit(root, mnist_dir, 6, "--ckpt_path", "last")
    (line,) = [line for line in out.splitlines() if line.startswith("warning: resume:")]
    assert f"{last} (its SHA-256 differs from the one saved in last.ckpt.sha256)" in line, line
    assert f"resuming from {previous}, the newest that reads" in line, line
    assert line.endswith("#checkpoint-corrupt"), line  # the link to the page that explains it
    assert f"resume from  {previous} (--ckpt_path last: the newest last.ckpt)" in out, out[-3000:]
    kept = last.with_name("last.ckpt.unreadable")
    assert kept.read_bytes() == damaged  # kept, not deleted, out of the way of the new saves
    assert state(last)["global_step"] == 6 and sorted(p.name for p in root.iterdir()) == ["version_0"]

    reference = tmp_path / "reference"  # the same run, never interrupted
    fit(reference, mnist_dir, 6)
    ours, theirs = state(last)["state_dict"], state(last_of(reference))["state_dict"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "the resumed run's weights differ"


@pytest.mark.slow
def test_a_learning_rate_changed_on_resume_is_applied_and_every_difference_is_said(mnist_dir, tmp_path):
    root = tmp_path / "run"
    fit(root, mnist_dir, 2)
    saved = state(last_of(root))["optimizer_states"][0]["param_groups"][0]
    assert saved["initial_lr"] == 0.1

    out = fit(root, mnist_dir, 4, "--ckpt_path", "last", "--model.optimizer.init_args.lr", "0.0123")
    block = out[out.index("resume: 2 setting(s) differ from the checkpoint's run:") :].splitlines()[:3]
    assert block[1].startswith(
        f"  model.optimizer.init_args.lr: 0.1 -> 0.0123 (applied: the restored lr {saved['lr']:.4g} -> "
    ), block
    assert block[2] == "  trainer.max_steps: 2 -> 4", block
    resumed = state(last_of(root))
    group, scheduler = resumed["optimizer_states"][0]["param_groups"][0], resumed["lr_schedulers"][0]
    assert group["initial_lr"] == 0.0123 and scheduler["base_lrs"] == [0.0123], (group, scheduler)
    # the schedule went on from step 2 at the new scale: the lr it reached is 0.123 x what the unchanged run reaches
    unchanged = tmp_path / "unchanged"
    fit(unchanged, mnist_dir, 4)
    reached = state(last_of(unchanged))["optimizer_states"][0]["param_groups"][0]["lr"]
    assert group["lr"] == pytest.approx(reached * 0.123, rel=1e-9), (group["lr"], reached)

    again = fit(root, mnist_dir, 6, "--ckpt_path", "last", "--model.optimizer.init_args.lr", "0.0123")
    assert "model.optimizer.init_args.lr" not in again  # the checkpoint now holds the run's new lr: nothing to say
