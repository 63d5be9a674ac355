"""One LightningModule for every task: an injected network, cross-entropy, top-1/top-5 accuracy.

It never knows which strategy runs it: metrics are torchmetrics objects, whose states (sums and counts) are reduced
across ranks when they are computed, so accuracies are exact for any world size.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from modules import zoo


class ImageClassifier(LightningModule):
    """Image classifier around a network from :mod:`modules.zoo`.

    Args:
        arch: network name (``mnist_cnn`` or any torchvision classification model, e.g. ``resnet50``).
        num_classes: linked from the datamodule by the CLI.
        in_channels: linked from the datamodule by the CLI (1 for MNIST, 3 for ImageNet).
        optimizer: the optimizer, e.g. in YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.1}}``
            or ``--model.optimizer SGD --model.optimizer.lr 0.1`` on the command line.
        lr_scheduler: optional LR scheduler given the same way (e.g. ``torch.optim.lr_scheduler.StepLR``).
        lr_scheduler_interval: step the scheduler every ``epoch`` or every optimizer ``step``.
        label_smoothing: cross-entropy label smoothing.
    """

    def __init__(
        self,
        arch: str = "mnist_cnn",
        num_classes: int = 10,
        in_channels: int = 1,
        optimizer: OptimizerCallable = lambda params: torch.optim.Adam(params, lr=1e-3),
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: Literal["epoch", "step"] = "epoch",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.net = zoo.build(arch, num_classes=num_classes, in_channels=in_channels)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        top5 = min(5, num_classes)
        self.metrics = torch.nn.ModuleDict(
            {
                f"{stage}_{name}": metric
                for stage in ("train", "val", "test")
                for name, metric in (
                    ("acc1", MulticlassAccuracy(num_classes, top_k=1, average="micro")),
                    ("acc5", MulticlassAccuracy(num_classes, top_k=top5, average="micro")),
                    ("loss", MeanMetric()),
                )
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        on_step = stage == "train"
        self.metrics[f"{stage}_loss"](loss.detach(), weight=y.numel())
        self.metrics[f"{stage}_acc1"](logits.detach(), y)
        self.log(f"{stage}/loss", self.metrics[f"{stage}_loss"], on_step=on_step, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc1", self.metrics[f"{stage}_acc1"], on_step=on_step, on_epoch=True, prog_bar=True)
        if stage != "train":
            self.metrics[f"{stage}_acc5"](logits.detach(), y)
            self.log(f"{stage}/acc5", self.metrics[f"{stage}_acc5"], on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x = batch[0] if isinstance(batch, list | tuple) else batch
        probs = self(x).softmax(dim=-1)
        return {"pred": probs.argmax(dim=-1), "prob": probs}

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.lr_scheduler_interval},
        }
