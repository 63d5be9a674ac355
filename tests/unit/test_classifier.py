"""The classifier trained by a real Trainer on real MNIST for a few steps."""

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
