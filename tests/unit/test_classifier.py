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
