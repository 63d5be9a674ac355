"""The run identity is a record every checkpoint carries under its own key (``app.checkpoint.identity``), whatever the
class that wrote it is called; a start reads each checkpoint once, however many parts of the app ask about it."""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

import pytest
import torch

import app.command
from app.checkpoint import Checkpoints, From, RunIdentity
from app.command import main
from app.loggers import TrackingConfigCallback
from core.env import detect
from tests.conftest import short_fit

NO_SCHEDULE = ["--model.lr_scheduler", "null"]  # a resumed run may then train longer than the first one


class RunRecorder(TrackingConfigCallback):
    """The CLI's config callback under another name (a rename in a later version of the app)."""


@pytest.fixture(scope="module")
def first_run(mnist_dir, tmp_path_factory):
    """A real 2-step fit whose checkpoints were written by :class:`RunRecorder`."""
    root = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app.command, "TrackingConfigCallback", RunRecorder)
        patch.setattr(sys, "argv", ["cli.py"])
        main(["fit", *short_fit(root, mnist_dir, 2, 1), *NO_SCHEDULE])
    return root


def test_a_renamed_identity_callback_still_resumes_its_run(first_run, mnist_dir, caplog):
    last = first_run / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert set(RunIdentity.of(saved).as_dict()) == {"tensorboard_version", "config"}
    assert saved[RunIdentity.KEY]["tensorboard_version"] == "version_0"
    assert not [k for k in saved["callbacks"] if "Recorder" in k or "TrackingConfig" in k]  # no class name is a key

    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    args = [*short_fit(first_run, mnist_dir, 2, 1, batch_size=32, epochs=2), *NO_SCHEDULE]
    cli = main(["fit", *args, "--ckpt_path", "last"])  # written by RunRecorder, read with the CLI's own class
    assert f"Resuming from {last}: continuing TensorBoard version_0" in caplog.messages
    assert cli.trainer.logger.version == "version_0" and cli.trainer.global_step == 4
    (changed,) = [m for m in caplog.messages if m.startswith("resume: ") and "differ from the checkpoint's run" in m]
    assert "data.init_args.batch_size: 256 -> 32" in changed, changed  # the saved configuration was read
    assert "trainer.max_epochs: 1 -> 2" in changed, changed


def test_a_checkpoint_saved_before_the_record_still_names_its_job(tmp_path):
    """Checkpoints saved by earlier versions kept the identity as their config callback's state: still read."""
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    old = {"TrackingConfigCallback": {"torchrun_job": "job-a", "wandb_id": "w0"}, "RNGState": {"ranks": []}}
    torch.save({"callbacks": old}, last)
    env = {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "1", "WORLD_SIZE": "2"}
    decision = Checkpoints(tmp_path).decide(None, "fit", detect(env))
    assert (decision.path, decision.source) == (last, From.TORCHRUN)
    assert decision.identity == RunIdentity(wandb_id="w0", torchrun_job="job-a")


def test_a_resumed_start_reads_and_verifies_its_checkpoint_once(first_run, mnist_dir, monkeypatch):
    """The resume decision, the CLI's checks, the loggers, the changed settings and Lightning's own load all ask
    about ``last.ckpt``: it is loaded once and its SHA-256 checked once."""
    last = first_run / "version_0" / "checkpoints" / "last.ckpt"
    loads, checks = [], []
    real_load = torch.load

    def load(f, *args, **kwargs):
        loads.append(str(f))
        return real_load(f, *args, **kwargs)

    def checksum(path):
        checks.append(str(path))
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr("app.checkpoint.reading.file_checksum", checksum)  # where the reader hashes a file
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    cli = main(["validate", *short_fit(first_run, mnist_dir, 2, 1), *NO_SCHEDULE, "--ckpt_path", "last"])
    assert cli.trainer.ckpt_path == str(last) and "val/acc1" in cli.trainer.callback_metrics
    assert loads.count(str(last)) == 1, loads
    assert checks.count(str(last)) == 1, checks
