"""The classifier trained by a real Trainer on real MNIST for a few steps."""

import warnings

import pytest
import torch
from lightning.pytorch import seed_everything

from datamodules import MNISTDataModule
from modules import ImageClassifier
from tests.conftest import fast_trainer


def test_fit_validate_test_predict(mnist_dir, tmp_path):
    seed_everything(0)
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=64)
    model = ImageClassifier(arch="mnist_cnn", num_classes=10, in_channels=1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = fast_trainer(tmp_path, limit_train_batches=30, limit_val_batches=5, limit_test_batches=5)
    trainer.fit(model, dm)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    metrics = trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/acc1", "val/acc5"):
        assert key in metrics, key
    assert metrics["val/acc1"] > 0.5  # 30 Adam steps already learn MNIST well past chance (0.1)
    assert metrics["val/acc5"] >= metrics["val/acc1"]
    (test,) = trainer.test(model, dm, verbose=False)
    assert set(test) == {"test/loss", "test/acc1", "test/acc5"}
    batches = trainer.predict(model, dm)
    assert batches[0]["pred"].shape == (64,) and torch.allclose(batches[0]["prob"].sum(-1), torch.ones(64))


def test_scheduler_steps_per_epoch(mnist_dir, tmp_path):
    model = ImageClassifier(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    trainer = fast_trainer(tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir)))
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**2


@pytest.mark.parametrize(("total_iters", "warned"), [(10, "stops 6 steps before the end"), (4, None)])
def test_per_step_schedule_length_must_match_the_run(mnist_dir, tmp_path, total_iters, warned):
    """A LinearLR over total_iters steps in a run of another length is said, with the number to use."""
    model = ImageClassifier(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.01, total_iters=total_iters),
        lr_scheduler_interval="step",
    )
    trainer = fast_trainer(tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir)))
    messages = [str(w.message) for w in seen if "total_iters" in str(w.message)]
    if warned:
        (message,) = messages
        assert warned in message and "--model.lr_scheduler.init_args.total_iters 4" in message
    else:
        assert messages == []
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.01)


@pytest.mark.parametrize(("t_max", "warned"), [(4, "ends at 50% of its peak instead of 0"), (1, "climbs back up"),
                                              (2, None)])  # fmt: skip
def test_a_cosine_schedule_over_other_epochs_than_the_run_is_said(mnist_dir, tmp_path, t_max, warned):
    """CosineAnnealingLR's T_max (epochs) against --trainer.max_epochs (2): the line says what the lr does, the fix."""
    model = ImageClassifier(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=t_max),
    )
    trainer = fast_trainer(tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir)))
    messages = [str(w.message) for w in seen if "T_max" in str(w.message)]
    if warned:
        (message,) = messages
        assert f"T_max={t_max} epochs but this run makes 2" in message and warned in message, message
        assert message.endswith("Fix: --model.lr_scheduler.init_args.T_max 2."), message
    else:
        assert messages == []
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine's end


def test_training_metrics_per_logging_step_and_over_the_epoch(mnist_dir, tmp_path):
    """``train/*`` are logged on logging steps only (this batch's values); the epoch's values are the image-weighted
    means over all of the epoch's batches: here, with every step logged, exactly the mean of the logged steps."""
    from lightning.pytorch import Callback

    class Record(Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            self.steps.append({k: float(metrics[k]) for k in ("train/loss", "train/acc1", "train/acc5")})

    seed_everything(0)
    record = Record()
    trainer = fast_trainer(tmp_path, limit_train_batches=8, limit_val_batches=2, log_every_n_steps=1)
    trainer.callbacks.append(record)
    trainer.fit(ImageClassifier(arch="mnist_cnn"), MNISTDataModule(data_dir=str(mnist_dir), batch_size=32))
    metrics = trainer.callback_metrics
    assert len(record.steps) == 8
    for key in ("train/loss", "train/acc1", "train/acc5"):
        mean = sum(step[key] for step in record.steps) / 8  # equal batches: the image-weighted mean
        assert float(metrics[f"{key}_epoch"]) == pytest.approx(mean, rel=1e-5), key
    assert all(step["train/acc5"] >= step["train/acc1"] for step in record.steps)
    assert metrics["train/acc5_epoch"] > metrics["train/acc1_epoch"]
    shown = set(trainer.progress_bar_metrics)  # the progress bar shows the loss and top-1, not top-5
    assert {"train/loss", "train/acc1"} <= shown and "train/acc5" not in shown


def test_the_epoch_loss_weighs_every_batch_by_its_images_logged_or_not(mnist_dir, tmp_path):
    """Batches of 32 and a last one of 5, logged every 3rd step: ``train/loss_epoch`` is the mean over every image of
    the epoch (each batch weighted by the images it really had), the logged steps and the others alike; the top-k
    epoch accuracies are counts of the epoch's images, so they are multiples of 1/229."""
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from datamodules.mnist import load_split

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[tuple[float, int]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append((float(outputs["loss"]), len(batch[1])))

    images, labels = load_split(mnist_dir, train=True)
    loader = DataLoader(TensorDataset(images[:229], labels[:229]), batch_size=32)  # 7 x 32 + 5
    seed_everything(0)
    record = Record()
    trainer = fast_trainer(tmp_path, limit_train_batches=1.0, limit_val_batches=0, log_every_n_steps=3)
    trainer.callbacks.append(record)
    trainer.fit(ImageClassifier(arch="mnist_cnn", num_classes=10, in_channels=1), train_dataloaders=loader)
    assert [n for _, n in record.losses] == [32] * 7 + [5]
    weighted = sum(loss * n for loss, n in record.losses) / 229
    unweighted = sum(loss for loss, _ in record.losses) / 8
    assert abs(weighted - unweighted) > 1e-4  # the test can tell them apart
    epoch = trainer.callback_metrics
    assert float(epoch["train/loss_epoch"]) == pytest.approx(weighted, rel=1e-6)
    for key in ("train/acc1_epoch", "train/acc5_epoch"):
        hits = float(epoch[key]) * 229
        assert hits == pytest.approx(round(hits), abs=1e-3) and 0 < round(hits) <= 229, key
    assert epoch["train/acc5_epoch"] > epoch["train/acc1_epoch"]


def test_training_values_reach_the_logger_only_on_logging_steps(mnist_dir, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="csv")
    trainer = fast_trainer(tmp_path, limit_train_batches=10, limit_val_batches=0, log_every_n_steps=4, logger=logger)
    model = ImageClassifier(arch="mnist_cnn")
    logged: list[int] = []
    original = model.log

    def counting_log(name, *args, **kwargs):
        if name == "train/loss":
            logged.append(trainer.global_step)
        return original(name, *args, **kwargs)

    model.log = counting_log
    trainer.fit(model, MNISTDataModule(data_dir=str(mnist_dir), batch_size=16))
    # steps 4 and 8 (Lightning's logging steps, global step counted before the optimizer step) and the last batch
    assert logged == [3, 7, 9]
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [int(r.split(",")[header.index("step")]) for r in rows[1:] if r.split(",")[header.index("train/loss")]]
    assert steps == [3, 7]


def test_an_epoch_of_one_image_still_has_its_epoch_values(mnist_dir, tmp_path):
    """The epoch values are logged whenever the epoch had an image, also just one (the smallest epoch there is)."""
    from torch.utils.data import DataLoader, TensorDataset

    from datamodules.mnist import load_split

    images, labels = load_split(mnist_dir, train=True)
    trainer = fast_trainer(tmp_path, limit_train_batches=1.0, limit_val_batches=0, log_every_n_steps=1)
    model = ImageClassifier(arch="mnist_cnn")
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(images[:1], labels[:1]), batch_size=1))
    metrics = trainer.callback_metrics
    assert float(metrics["train/loss_epoch"]) == pytest.approx(float(metrics["train/loss"]), rel=1e-6)
    assert float(metrics["train/acc5_epoch"]) == float(metrics["train/acc5"])
