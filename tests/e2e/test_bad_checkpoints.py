"""A ``--ckpt_path`` the run cannot use stops it before anything is built: one line naming the file, the cause and
the fix, a non-zero exit, and the run's good ``last.ckpt`` untouched. A checkpoint holding a pickled object that runs
code is refused by default (the object never runs) and loads only with the explicit ``--trust_checkpoint true``.

All in this process (``app.command.main``: its error channel prints the line on stderr and exits with status 1), on one
short real MNIST run whose checkpoint every case reuses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from app.checkpoint import AtomicCheckpointIO, Checkpoints, UnsafeCheckpointError
from app.command import main
from tests.conftest import short_fit


def args(root: Path, data_dir: Path, *extra: str) -> list[str]:
    return ["--model.arch", "mnist_cnn", *short_fit(root, data_dir, 2, 1, batch_size=16), *extra]


class MakesDirectory:
    """A malicious payload: unpickling it calls ``os.makedirs(marker)``, standing for any code an attacker wants run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker), 0o777, True)  # exist_ok: it may be loaded twice


@pytest.fixture(scope="module")
def trained(mnist_dir, tmp_path_factory) -> Path:
    """A real run folder with ``version_0/checkpoints/last.ckpt`` (mnist_cnn, 2 steps)."""
    root = tmp_path_factory.mktemp("good")
    main(["fit", *args(root, mnist_dir)])
    return root


@pytest.fixture
def refused(capsys):
    """Runs the CLI, expects it to stop with status 1 and a one-line message; returns that message."""

    def run(*argv: str) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            main(list(argv))
        err = capsys.readouterr().err
        (message,) = [line for line in err.splitlines() if line.startswith("error:")]  # one line, no traceback
        assert stop.value.code == 1 and message.startswith("error: --ckpt_path") and "Traceback" not in err, err
        assert "Fix:" in message, message
        return message

    return run


@pytest.mark.slow
def test_unusable_checkpoints_stop_before_anything_is_built(trained, mnist_dir, tmp_path, refused):
    last = trained / "version_0" / "checkpoints" / "last.ckpt"
    good_bytes, good_mtime = last.read_bytes(), last.stat().st_mtime_ns

    missing = refused("fit", *args(trained, mnist_dir, "--ckpt_path", str(tmp_path / "nope.ckpt")))
    assert str(tmp_path / "nope.ckpt") in missing and "no such file" in missing

    truncated = tmp_path / "copied.ckpt"  # an interrupted copy: the first half of a good file
    truncated.write_bytes(good_bytes[: len(good_bytes) // 2])
    message = refused("fit", *args(trained, mnist_dir, "--ckpt_path", str(truncated)))
    assert str(truncated) in message and "truncated or corrupt" in message

    flipped = tmp_path / "flipped" / "last.ckpt"  # one byte changed on disk: torch would load it, weights damaged
    flipped.parent.mkdir()
    shutil.copy(last.with_name("last.ckpt.sha256"), flipped.with_name("last.ckpt.sha256"))
    damaged = bytearray(good_bytes)
    damaged[len(damaged) // 2] ^= 0xFF
    flipped.write_bytes(bytes(damaged))
    message = refused("fit", *args(trained, mnist_dir, "--ckpt_path", str(flipped)))
    assert f"{flipped}: not a readable checkpoint; it is truncated or corrupt (its SHA-256 differs" in message

    # the configured network differs from the checkpoint's: Lightning would silently train mnist_cnn instead
    message = refused("fit", *args(trained, mnist_dir, "--model.arch", "resnet18", "--ckpt_path", str(last)))
    assert "holds a mnist_cnn network" in message and "--model.arch mnist_cnn" in message

    # `--ckpt_path last` takes no hyperparameters from the file: the weights are compared with the model instead
    message = refused("validate", *args(trained, mnist_dir, "--model.arch", "resnet18", "--ckpt_path", "last"))
    assert str(last) in message and "trained as mnist_cnn" in message and "model.arch=resnet18" in message

    assert last.read_bytes() == good_bytes and last.stat().st_mtime_ns == good_mtime  # the good file untouched
    assert sorted(p.name for p in trained.iterdir()) == ["version_0"]  # no new run folder was started


@pytest.mark.slow
def test_checkpoint_with_code_is_refused_unless_trusted(trained, mnist_dir, tmp_path, refused):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.ckpt"
    checkpoint = torch.load(trained / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    torch.save({**checkpoint, "extra": MakesDirectory(marker)}, evil)

    message = refused("validate", *args(trained, mnist_dir, "--ckpt_path", str(evil)))
    assert "os.makedirs" in message and "--trust_checkpoint true" in message
    with pytest.raises(UnsafeCheckpointError, match="--trust_checkpoint true"):  # Trainer/library path, no CLI
        AtomicCheckpointIO().load_checkpoint(evil)
    shutil.copy(evil, trained / "hpc_ckpt_1.ckpt")  # what SLURM resumes from without asking: read for the run id
    try:
        read = Checkpoints(trained).read(trained / "hpc_ckpt_1.ckpt")
        assert read.holds_code and read.state is None and read.identity.as_dict() == {}
    finally:
        (trained / "hpc_ckpt_1.ckpt").unlink()
    assert not marker.exists(), "refusing the checkpoint ran its code"

    # the explicit opt-out for a trusted legacy file: it loads (and, being malicious, runs its payload)
    trusted = args(tmp_path / "trusted", mnist_dir, "--ckpt_path", str(evil), "--trust_checkpoint", "true")
    cli = main(["validate", *trusted])
    assert marker.is_dir() and cli.trainer.strategy.checkpoint_io.weights_only is False
    # the trained weights were loaded: validated on the same images, the accuracy their training ended with
    (score,) = [v["best_model_score"] for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert cli.trainer.callback_metrics["val/acc1"].item() == pytest.approx(score.item(), abs=1e-6)
