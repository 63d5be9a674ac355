"""One LightningModule for every task: an injected network, cross-entropy, top-1/top-5 accuracy.

It never knows which strategy runs it: metrics are torchmetrics objects, whose states (sums and counts) are reduced
across ranks when they are computed, so accuracies are exact for any world size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from core.batch import BatchPlan, linear_scaled_lr
from core.device import Auto, flag
from core.env import compile_cache
from core.errors import UserError
from core.layout import layout_of
from core.logging_steps import is_logging_step
from modules import zoo

# the layers whose parameters ``norm_bias_weight_decay`` exempts (torchvision's set_weight_decay list)
NORM_LAYERS = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.LocalResponseNorm,
)
COMPILE_CACHE = "compile_cache"  # in the run folder: a restart, a requeue or the next run there compiles nothing again
FP16_EPS = 1e-4  # the eps an optimizer gets under 16-true when its own is 0 in float16 (_fp16_safe_eps)


class ImageClassifier(LightningModule):
    """Image classifier around a network from :mod:`modules.zoo`.

    Args:
        arch: network name (``mnist_cnn`` or any torchvision classification model, e.g. ``resnet50``).
        num_classes: linked from the datamodule by the CLI.
        in_channels: linked from the datamodule by the CLI (1 for MNIST, 3 for ImageNet).
        weights: start from pretrained weights: a torchvision weights name of ``arch`` (``IMAGENET1K_V2``,
            ``DEFAULT``) or a file (a state dict, or a checkpoint of this app); see :func:`modules.zoo.build`.
        optimizer: the optimizer, e.g. in YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.1}}``
            or ``--model.optimizer SGD --model.optimizer.lr 0.1`` on the command line.
        lr_scheduler: optional LR scheduler given the same way (e.g. ``torch.optim.lr_scheduler.StepLR``).
        lr_scheduler_interval: step the scheduler every ``epoch`` or every optimizer ``step``.
        label_smoothing: cross-entropy label smoothing (also of mixed labels, as torchvision's recipe).
        norm_weight_decay: the weight decay of normalisation layers' parameters, in a parameter group of their own
            (torchvision's ``--norm-weight-decay``; the modern recipe: 0.0; every other parameter, biases included,
            keeps the optimizer's); None: the optimizer's for every parameter.
        norm_bias_weight_decay: as ``norm_weight_decay``, for every bias too (timm's rule); give one of the two.
        lr_reference_batch_size: linear LR scaling: the optimizer's ``lr`` is the rate per this many images of
            global batch (256 in the ImageNet recipe) and the optimizer runs with ``lr x global batch / this``.
            The global batch is the datamodule's ``batch_size x world size x accumulate_grad_batches``.
            None: ``lr`` is used as given.
        warmup_epochs: ramp the learning rate linearly up to its scheduled value over this many epochs (0 = no
            warmup; Goyal et al. use 5 for large batches).
        warmup_interval: ``step``: the ramp rises every optimizer step from ~0 and scales the scheduler's lr;
            ``epoch``: torchvision's, ``LinearLR`` from ``warmup_start_factor`` stepped once per epoch, then the
            ``lr_scheduler`` (its ``T_max``: the epochs after the warm-up) through ``SequentialLR``.
        warmup_start_factor: the first epoch's share of the lr under ``warmup_interval: epoch`` (torchvision: 0.01).
        channels_last: keep weights and inputs in NHWC memory format (faster convolutions on tensor cores);
            ``auto``: on CUDA only.
        compile: compile the network with ``torch.compile`` (parameter names stay unchanged in checkpoints), its
            caches kept in ``<run folder>/compile_cache`` (:func:`core.env.compile_cache`) so that a restart does not
            compile again; ``auto``: on CUDA, where the strategy runs compiled models (not ``dp``'s replicas).
        float32_matmul_precision: ``high`` lets float32 matrix multiplications use TF32 tensor cores (Ampere and
            newer; cuDNN convolutions already do by default), as ``torch.set_float32_matmul_precision``; set when
            a run on CUDA starts, for the whole process. None leaves PyTorch's setting (``highest``) alone.
    """

    # `make mutation` leaves __init__ as it is: a mutmut trampoline there hides its arguments from save_hyperparameters
    def __init__(
        self,
        arch: str = "mnist_cnn",
        num_classes: int = 10,
        in_channels: int = 1,
        weights: str | None = None,
        optimizer: OptimizerCallable = lambda params: torch.optim.Adam(params, lr=1e-3),
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: Literal["epoch", "step"] = "epoch",
        label_smoothing: float = 0.0,
        norm_bias_weight_decay: float | None = None,
        lr_reference_batch_size: int | None = None,
        warmup_epochs: float = 0.0,
        warmup_interval: Literal["step", "epoch"] = "step",
        warmup_start_factor: float = 0.01,
        norm_weight_decay: float | None = None,
        channels_last: bool | Auto = False,
        compile: bool | Auto = False,
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
    ) -> None:  # pragma: no mutate block
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.net = zoo.build(arch, num_classes=num_classes, in_channels=in_channels, weights=weights)
        self.channels_last = False  # as resolved for the device (``auto``: at setup)
        self._apply_gpu_choices(flag(channels_last, False), flag(compile, False))
        # images evaluated per stage, summed over ranks: proves exact evaluation ("evaluated 50000/50000")
        self.eval_counts = {"val": 0, "test": 0}
        self.evaluated: dict[str, tuple[int, int]] = {}
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        top5 = self._top5 = min(5, num_classes)
        self._reset_train_sums()
        self.metrics = torch.nn.ModuleDict(
            {
                f"{stage}_{name}": metric
                for stage in ("val", "test")  # training sums plain tensors (_log_train_step)
                for name, metric in (
                    ("acc1", MulticlassAccuracy(num_classes, top_k=1, average="micro")),
                    ("acc5", MulticlassAccuracy(num_classes, top_k=top5, average="micro")),
                    ("loss", MeanMetric()),
                )
            }
        )

    def _apply_gpu_choices(self, channels_last: bool, compile: bool) -> None:
        if channels_last and not self.channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
            self.channels_last = True
        if compile and self.net._compiled_call_impl is None:
            self.net.compile()  # in place: the state_dict keeps its names (no ``_orig_mod.`` prefix)

    def setup(self, stage: str) -> None:
        cuda = self._trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        # dp's replicas cannot run a compiled model (app.strategies.dp): compile auto leaves it to them
        compiles = layout_of(self.trainer.strategy).runs_compiled_models if self._trainer is not None else True
        compile = flag(self.hparams.get("compile", False), cuda and compiles)
        self._apply_gpu_choices(flag(self.hparams.get("channels_last", False), cuda), compile)
        if compile and self._trainer is not None:
            compile_cache(Path(self.trainer.default_root_dir) / COMPILE_CACHE)
        if cuda and self.hparams.get("float32_matmul_precision"):
            torch.set_float32_matmul_precision(self.hparams.float32_matmul_precision)
        # The model summary runs this input through the network for its FLOPs and in/out sizes column (all 0
        # without it), in the dtype the precision gives real batches (16-true/bf16-true weights refuse float32).
        # Not with compile: the summary's no_grad forward would compile a second graph at start-up.
        shape = getattr(self.trainer.datamodule, "input_shape", None) if self._trainer is not None else None
        if shape is not None and self.net._compiled_call_impl is None:
            self.example_input_array = self.trainer.precision_plugin.convert_input(torch.zeros(1, *shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def forward_step(self, batch) -> dict[str, torch.Tensor]:
        """Forward and loss of one batch, without logging. Under ``dp`` this runs in every GPU's replica. Labels are
        class indices, or probabilities (mixed by MixUp/CutMix: the loss is against them, the accuracy against the
        class each image mostly is)."""
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        return {"loss": loss, "logits": logits, "target": y.argmax(-1) if y.is_floating_point() else y}

    def log_step(self, outputs: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """Metrics and logging of one batch, run once (under ``dp``: on the root device, on the gathered outputs)."""
        loss, logits, y = outputs["loss"], outputs["logits"], outputs["target"]
        # training metrics per step, evaluation metrics per epoch: the keys stay exactly `train/loss`, `val/acc1`, ...
        if stage == "train":
            self._log_train_step(loss.detach(), logits.detach(), y)
            return loss
        self.metrics[f"{stage}_loss"](loss.detach(), weight=y.numel())
        self.metrics[f"{stage}_acc1"](logits.detach(), y)
        self.metrics[f"{stage}_acc5"](logits.detach(), y)
        self.eval_counts[stage] += y.numel()
        self.log(f"{stage}/loss", self.metrics[f"{stage}_loss"], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc1", self.metrics[f"{stage}_acc1"], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/acc5", self.metrics[f"{stage}_acc5"], on_step=False, on_epoch=True)
        return loss

    def _log_train_step(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """This rank's batch: loss, top-1 and top-5 accuracy, added to the epoch's sums on the device every step (a
        few in-place ops) and logged only on logging steps (``core.logging_steps``), with one device-to-host copy
        there: no host read and no ``self.log`` call on the other steps. (A torchmetrics forward per step cost ~5 ms
        of Python on a CPU.)"""
        n = y.numel()
        # one row per image, True where the target is among its top-k: column 0 = top-1, any column = top-k
        hits = (logits.topk(self._top5, dim=-1).indices == y.unsqueeze(-1)).sum(dim=0)
        if self._train_loss.device != loss.device:  # (the epoch started before the model reached its device)
            self._train_loss, self._train_hits = self._train_loss.to(loss.device), self._train_hits.to(loss.device)
        self._train_loss.add_(loss, alpha=n)
        self._train_hits.add_(hits)
        self._train_images += n
        if self._trainer is None or not is_logging_step(self.trainer):
            return
        values = (torch.stack([loss.float() * n, hits[0].float(), hits.sum().float()]) / n).cpu()
        # CPU tensors: Lightning's progress bar reads them on every later step without a device sync
        for name, value in zip(("train/loss", "train/acc1", "train/acc5"), values, strict=True):
            self.log(name, value, on_step=True, on_epoch=False, prog_bar=name != "train/acc5")

    def on_train_epoch_start(self) -> None:
        self._reset_train_sums(self.device)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The running epoch's training sums, over every rank, so that ``train/*_epoch`` of an epoch resumed
        mid-way averages all its batches, not only those after the resume. A collective: Lightning builds the
        checkpoint on every rank (only rank 0 writes it), as :class:`app.callbacks.RNGState`'s gather relies on too.
        Not in a weights-only save, which nothing resumes from."""
        if "optimizer_states" not in checkpoint or self._trainer is None:
            return
        dtype = self._train_loss.dtype
        images = self._train_loss.new_tensor([self._train_images])
        sums = torch.cat([self._train_loss.view(1), self._train_hits.to(dtype), images])
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum")
        checkpoint["train_epoch_sums"] = {"epoch": self.trainer.current_epoch, "sums": sums.cpu()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A run resumed mid-epoch carries on with the epoch's sums so far: rank 0 with every rank's (saved summed
        over the ranks), the others from zero. (Lightning does not call ``on_train_epoch_start`` for the epoch it
        resumes in; an epoch that starts after the resume resets them there.)"""
        saved = checkpoint.get("train_epoch_sums")
        if saved is None or self._trainer is None:
            return
        self._reset_train_sums()
        if self.trainer.global_rank == 0:
            # the checkpoint is loaded onto this rank's device (app.checkpoint) while the model and its sums are
            # still on the host (Lightning restores before it moves the model): the sums join them there
            sums = saved["sums"].to(self._train_loss.device)
            self._train_loss += sums[0].to(self._train_loss.dtype)
            self._train_hits += sums[1:-1].round().to(self._train_hits.dtype)
            self._train_images = int(sums[-1].item())

    def _reset_train_sums(self, device: torch.device | str = "cpu") -> None:
        # this epoch: the summed loss x images, the top-1..top-k hit counts, the images (on the host)
        dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64  # (MPS has no float64)
        self._train_loss = torch.zeros((), dtype=dtype, device=device)
        self._train_hits = torch.zeros(self._top5, dtype=torch.int64, device=device)
        self._train_images = 0

    def on_train_epoch_end(self) -> None:
        """The epoch's training loss and accuracies over every rank's batches, with one all-reduce of four numbers
        per epoch (the per-step ``train/*`` values are this rank's batch): ``train/loss_epoch``, ``train/acc1_epoch``,
        ``train/acc5_epoch``."""
        hits = self._train_hits.to(self._train_loss.dtype)
        sums = torch.stack([self._train_loss, hits[0], hits.sum(), hits.new_tensor(self._train_images)])
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum").tolist()
        if sums[3] > 0:
            names = ("train/loss_epoch", "train/acc1_epoch", "train/acc5_epoch")
            # equal on every rank already; sync_dist's mean keeps them so (and keeps Lightning from warning)
            values = {name: total / sums[3] for name, total in zip(names, sums, strict=False)}
            self.log_dict(values, on_epoch=True, sync_dist=True)

    def _step(self, batch, stage: str) -> torch.Tensor:
        return self.log_step(self.forward_step(batch), stage)

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

    def on_validation_start(self) -> None:
        self._loss_metrics_in_fp32()

    def on_test_start(self) -> None:
        self._loss_metrics_in_fp32()

    def _loss_metrics_in_fp32(self) -> None:
        """16-true/bf16-true convert the whole module with ``module.to(dtype)``, which casts the ``MeanMetric`` sums
        too: summed in half they stall (a loss wrong by 15% over MNIST's 10k test images in bf16; inf in fp16). Back
        to fp32 after that conversion; the accuracies' states are integers, the training sums plain fp64 tensors."""
        for metric in self.metrics.values():
            if isinstance(metric, MeanMetric) and metric.mean_value.dtype != torch.float32:
                metric.set_dtype(torch.float32)

    def on_validation_epoch_end(self) -> None:
        self._report_evaluated("val")

    def on_test_epoch_end(self) -> None:
        self._report_evaluated("test")

    def _report_evaluated(self, stage: str) -> None:
        """Prints ``evaluated N/M images``: N counted in the steps (summed over ranks), M the size of the data set."""
        local = torch.tensor(self.eval_counts[stage], device=self.device)
        seen = int(self.trainer.strategy.reduce(local, reduce_op="sum").item())  # every rank takes part
        self.eval_counts[stage] = 0
        if self.trainer.sanity_checking:
            return
        loaders = self.trainer.val_dataloaders if stage == "val" else self.trainer.test_dataloaders
        loaders = loaders if isinstance(loaders, list | tuple) else [loaders]
        total = sum(len(dl.dataset) for dl in loaders if hasattr(getattr(dl, "dataset", None), "__len__"))
        self.evaluated[stage] = (seen, total)
        note = "" if seen == total else " (fewer: limit_*_batches, or skipped unreadable images)"
        rank_zero_info(f"{stage}: evaluated {seen}/{total} images{note}")

    def global_batch_size(self) -> int:
        """Images per optimizer step over all processes, from the datamodule's batch and the trainer."""
        datamodule = self.trainer.datamodule
        known = getattr(datamodule, "global_batch_size", None)
        if known:
            return int(known)
        batch_size = getattr(datamodule, "batch_size", None)
        if batch_size is None:
            raise ValueError(
                "model.lr_reference_batch_size needs the global batch, but the datamodule has no batch_size "
                "attribute. Set model.lr_reference_batch_size null and give the final lr to the optimizer."
            )
        return BatchPlan(batch_size, self.trainer.world_size, self.trainer.accumulate_grad_batches).global_batch

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        factor = self._warmup_factor()
        if factor >= 1.0:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Warmup scales the scheduled lr for this step only and restores it, so the scheduler stays the one owner
        # of the lr (an extra LambdaLR would overwrite an epoch-wise StepLR's decay).
        scheduled = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= factor
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr

    def _warmup_factor(self) -> float:
        warmup_epochs = self.hparams.get("warmup_epochs") or 0.0
        if warmup_epochs <= 0 or self.hparams.get("warmup_interval", "step") == "epoch":
            return 1.0
        steps_per_epoch = self.trainer.num_training_batches / self.trainer.accumulate_grad_batches
        warmup_steps = max(1, round(warmup_epochs * steps_per_epoch))
        return min(1.0, (self.trainer.global_step + 1) / warmup_steps)

    def param_groups(self) -> list[dict[str, Any]] | Any:
        """The optimizer's parameters: all of them, or two groups, the second holding the normalisation layers'
        parameters with ``norm_weight_decay`` (torchvision's ``set_weight_decay``: every other parameter, ``fc.bias``
        included, keeps the optimizer's), or those and every bias with ``norm_bias_weight_decay`` (timm's)."""
        norm_decay, bias_decay = self.hparams.get("norm_weight_decay"), self.hparams.get("norm_bias_weight_decay")
        if norm_decay is not None and bias_decay is not None:
            raise UserError(
                "model.norm_weight_decay (normalisation layers) and model.norm_bias_weight_decay (those and every "
                "bias) are both given: give one (--model.norm_bias_weight_decay null)"
            )
        if norm_decay is None and bias_decay is None:
            return self.parameters()
        norms = {id(p) for m in self.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)}
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        exempt = {id(p) for n, p in named if id(p) in norms or (bias_decay is not None and n.endswith(".bias"))}
        others = [p for _, p in named if id(p) not in exempt]
        decay = norm_decay if norm_decay is not None else bias_decay
        return [{"params": others}, {"params": [p for _, p in named if id(p) in exempt], "weight_decay": decay}]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.param_groups())
        self._fp16_safe_eps(optimizer)
        reference = self.hparams.get("lr_reference_batch_size")
        if reference:
            global_batch = self.global_batch_size()
            base = optimizer.param_groups[0]["lr"]
            for group in optimizer.param_groups:
                group["lr"] = linear_scaled_lr(group["lr"], global_batch, reference)
            rank_zero_info(
                f"learning rate {optimizer.param_groups[0]['lr']:g} = {base:g} per {reference} images x global batch "
                f"{global_batch} / {reference} (linear scaling, model.lr_reference_batch_size)"
            )
        scheduler = None
        if self.lr_scheduler_factory is not None:
            scheduler = self._scheduler(optimizer)
            self._check_schedule_length(scheduler)
        scheduler = self._epoch_warmup(optimizer, scheduler)
        if scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.lr_scheduler_interval},
        }

    def _epoch_warmup_epochs(self) -> int:
        """The warm-up's epochs under ``warmup_interval: epoch`` (0 otherwise)."""
        epochs = self.hparams.get("warmup_epochs") or 0.0
        if self.hparams.get("warmup_interval", "step") != "epoch" or epochs <= 0:
            return 0
        if epochs != int(epochs) or self.hparams.lr_scheduler_interval != "epoch":
            raise UserError(
                f"model.warmup_interval epoch steps the warm-up once per epoch: it needs whole model.warmup_epochs "
                f"(got {epochs:g}) and model.lr_scheduler_interval epoch (got {self.hparams.lr_scheduler_interval}). "
                "Fix: --model.warmup_epochs 5, or --model.warmup_interval step (a ramp over optimizer steps)."
            )
        return int(epochs)

    def _epoch_warmup(self, optimizer: torch.optim.Optimizer, main: Any) -> Any:
        """torchvision's warm-up (references/classification/train.py): ``LinearLR`` from ``warmup_start_factor`` over
        the warm-up epochs, then ``main`` through ``SequentialLR``, built in its order (``main`` first, as each
        scheduler's construction sets the lr), so the lr of every epoch is torchvision's; ``main`` alone otherwise."""
        epochs = self._epoch_warmup_epochs()
        if not epochs:
            return main
        lr = torch.optim.lr_scheduler
        warmup = lr.LinearLR(optimizer, start_factor=self.hparams.get("warmup_start_factor", 0.01), total_iters=epochs)
        return warmup if main is None else lr.SequentialLR(optimizer, [warmup, main], milestones=[epochs])

    def _fp16_safe_eps(self, optimizer: torch.optim.Optimizer) -> None:
        """Under 16-true the optimizer's state and arithmetic are fp16, where Adam's default ``eps=1e-8`` is 0 and the
        second moment underflows: the weights turn inf/NaN after one step. An ``eps`` below fp16's smallest normal
        number becomes ``FP16_EPS``, said in one line."""
        if self._trainer is None or self.trainer.precision != "16-true":
            return
        tiny = torch.finfo(torch.float16).tiny
        groups = [g for g in optimizer.param_groups if isinstance(g.get("eps"), float) and g["eps"] < tiny]
        if groups:
            given = groups[0]["eps"]
            for group in groups:
                group["eps"] = FP16_EPS
            rank_zero_warn(
                f"16-true: {type(optimizer).__name__} eps={given:g} is 0 in float16 (the weights would turn "
                f"inf/NaN after one step), so eps={FP16_EPS:g} is used (an eps of at least {tiny:.2g} is kept: "
                "--model.optimizer.init_args.eps)"
            )

    def _run_steps(self) -> int | None:
        """This run's optimizer steps when stepped per step under a Trainer with a finite length, else None."""
        if self._trainer is None or self.hparams.lr_scheduler_interval != "step":
            return None  # (configure_optimizers called by hand, without a Trainer: no run length to compare with)
        steps = self.trainer.estimated_stepping_batches
        return int(steps) if math.isfinite(steps) else None

    def _scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """The scheduler; a ``OneCycleLR`` given neither ``total_steps`` nor ``epochs`` runs over this run's steps."""
        keywords = getattr(self.lr_scheduler_factory, "keywords", {})  # jsonargparse's functools.partial
        steps = self._run_steps()
        given_lr = optimizer.param_groups[0]["lr"]
        if isinstance(keywords.get("max_lr"), float) and keywords["max_lr"] != given_lr:
            rank_zero_warn(
                f"lr_scheduler OneCycleLR sets the learning rate from its max_lr {keywords['max_lr']:g}: the "
                f"optimizer's lr {given_lr:g} is not used. To change the peak learning rate: "
                f"--model.lr_scheduler.init_args.max_lr {given_lr:g}"
            )
        fill = "total_steps" in keywords and keywords["total_steps"] is None and keywords.get("epochs") is None
        try:
            if fill and steps:
                rank_zero_info(f"lr_scheduler: total_steps {steps}, this run's optimizer steps")
                return self.lr_scheduler_factory(optimizer, total_steps=steps)
            return self.lr_scheduler_factory(optimizer)
        except ZeroDivisionError as err:  # OneCycleLR whose warm-up phase is 0 steps long (pct_start x steps = 1)
            cls = getattr(self.lr_scheduler_factory, "args", [None])[-1]  # the class jsonargparse's partial builds
            raise UserError(
                f"lr_scheduler {getattr(cls, '__name__', '')} cannot schedule a run of {steps} optimizer steps with "
                f"pct_start {keywords.get('pct_start')}: one of its phases would last 0 steps. Fix: another "
                "--model.lr_scheduler.init_args.pct_start, a longer run, or --model.lr_scheduler null (a constant "
                "learning rate)."
            ) from err

    def on_train_start(self) -> None:
        """A ``OneCycleLR`` shorter than the run stops it with a ValueError at the step past its end: refused here,
        before the first step, once a resumed run has its checkpoint's schedule (which a longer run cannot extend)."""
        steps = self._run_steps()
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) or steps is None:
                continue
            if scheduler.total_steps >= steps:
                continue
            resumed = self.trainer.ckpt_path is not None
            fix = (
                "resume with the run's own length (its trainer.max_epochs / max_steps), or train a new cycle from its "
                "weights: a new run with --model.weights CHECKPOINT"
                if resumed
                else "leave --model.lr_scheduler.init_args.total_steps out (null: the run's length) or give "
                f"--model.lr_scheduler.init_args.total_steps {steps}"
            )
            raise UserError(
                f"lr_scheduler OneCycleLR {'of the checkpoint ' if resumed else ''}runs over "
                f"total_steps={scheduler.total_steps} optimizer steps but this run makes {steps}: it would stop the "
                f"run with an error at step {scheduler.total_steps + 1}. Fix: {fix}."
            )

    def _check_cosine_length(self, scheduler) -> None:
        """A cosine schedule's ``T_max`` (epochs, or optimizer steps with ``--model.lr_scheduler_interval step``) must
        be the run's length: shorter, the cosine climbs back up (it is periodic); longer, it never reaches its end."""
        t_max = getattr(scheduler, "T_max", None)
        if not isinstance(t_max, int) or self._trainer is None:
            return
        per_step = self.hparams.lr_scheduler_interval == "step"
        warmup = 0 if per_step else self._epoch_warmup_epochs()  # torchvision's cosine spans the epochs after it
        run = self._run_steps() if per_step else self.trainer.max_epochs - warmup
        if run is None or run <= 0 or run == t_max:
            return
        unit = "optimizer steps" if per_step else "epochs"
        after = f" after its {warmup} warm-up epochs" if warmup else ""
        effect = (
            f"climbs back up after {t_max} (a cosine is periodic)"
            if t_max < run
            else f"ends at {100 * (1 + math.cos(math.pi * run / t_max)) / 2:.0f}% of its peak instead of 0"
        )
        rank_zero_warn(
            f"lr_scheduler {type(scheduler).__name__} runs over T_max={t_max} {unit} but this run makes {run}{after}, "
            f"so the learning rate {effect}. Fix: --model.lr_scheduler.init_args.T_max {run}."
        )

    def _check_schedule_length(self, scheduler) -> None:
        """A per-step schedule with a fixed length (``LinearLR``'s ``total_iters``, ``OneCycleLR``'s
        ``total_steps``) must match the run's length (a too short ``OneCycleLR``: :meth:`on_train_start`)."""
        self._check_cosine_length(scheduler)
        length = getattr(scheduler, "total_iters", getattr(scheduler, "total_steps", None))
        steps = self._run_steps()
        if not isinstance(length, int) or steps is None:
            return
        if length != steps:
            name = "total_iters" if hasattr(scheduler, "total_iters") else "total_steps"
            gap = abs(steps - length)
            effect = (
                f"stays at its final value for the last {gap} steps"
                if length < steps
                else f"stops {gap} steps before the end of its schedule (never reaching its final value)"
            )
            rank_zero_warn(
                f"lr_scheduler {type(scheduler).__name__} runs over {name}={length} optimizer steps but this run "
                f"makes {steps}, so the learning rate {effect}. "
                f"Fix: --model.lr_scheduler.init_args.{name} {steps} (max_epochs x steps per epoch)."
            )
