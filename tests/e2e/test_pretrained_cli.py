"""``--model.weights`` through the real CLI: offline without the file, one line naming where torchvision expects it;
with the file in the cache, a fine-tuned run whose checkpoint resumes after the file is gone (nothing re-read or
downloaded). The network is cut off by a proxy on a closed port, so the tests behave the same on a machine online."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from tests.conftest import ROOT, run_cli

OFFLINE = {"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}


def run_args(root: Path, data_dir: Path, *extra: str) -> list[str]:
    return [
        # the previous recipe (SGD with a per-step schedule): the resumed run trains on past the first run's length,
        # and its second epoch improves val/acc1, so that epoch's checkpoint is the last one saved
        "fit", "--config", "configs/mnist_2epochs.yaml",
        "--model.arch", "resnet18", "--model.weights", "IMAGENET1K_V1", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
        "--data.batch_size", "8", "--data.data_dir", str(data_dir), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_missing_weights_offline_name_the_file_to_put_in_the_cache(mnist_dir, tmp_path):
    home = tmp_path / "empty_torch_home"
    result = run_cli(*run_args(tmp_path / "run", mnist_dir), env={"TORCH_HOME": str(home), **OFFLINE})
    expected = home / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert f"resnet18's file {expected} is missing and could not be downloaded" in line
    assert f"`wget https://download.pytorch.org/models/resnet18-f37072fd.pth -P {expected.parent}`" in line
    assert not (tmp_path / "run" / "version_0" / "checkpoints").exists()


@pytest.mark.slow
def test_fine_tuned_run_resumes_without_the_weights_file(mnist_dir, tmp_path):
    home, root = tmp_path / "torch_home", tmp_path / "run"
    cached = home / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.manual_seed(0)
    published = torchvision.models.resnet18().state_dict()
    torch.save(published, cached)
    env = {"TORCH_HOME": str(home), **OFFLINE}
    first = run_cli(*run_args(root, mnist_dir), env=env, cwd=ROOT)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output[-3000:]
    assert "model.weights IMAGENET1K_V1: classifier head fc replaced, 1000 -> 10 classes" in output
    assert "first convolution conv1 adapted from 3 to 1 input channels, the pretrained kernels summed" in output
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    trained = torch.load(last, weights_only=True)["state_dict"]
    assert trained["net.fc.weight"].shape == (10, 512)
    # fine-tuning moved the pretrained weights, which it started from
    assert not torch.equal(trained["net.layer4.1.conv2.weight"], published["layer4.1.conv2.weight"])

    cached.unlink()  # gone: resuming must not need it (nor try to download it)
    second = run_cli(*run_args(root, mnist_dir, "--ckpt_path", "last", "--trainer.max_epochs", "2"), env=env)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-3000:]
    assert "model.weights IMAGENET1K_V1 not loaded: the checkpoint holds the network's weights" in output
    assert "Downloading" not in output and not cached.exists()
    assert torch.load(last, weights_only=True)["epoch"] == 1  # the second epoch ran on the resumed weights
