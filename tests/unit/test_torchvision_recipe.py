"""configs/imagenet_modern.yaml against torchvision's reference scripts (references/classification train.py,
utils.py, sampler.py): the lr of every one of its 600 epochs, the weight decay of every ResNet-50 parameter, the
repeated-augmentation sampler's indices, and the moving average's updates and decay. torchvision's side is its own
code: torch's schedulers as its train.py builds them, and copies of its ``set_weight_decay`` and ``RASampler``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from app.callbacks import EMA
from core.batch import torchvision_adjusted
from datamodules import MNISTDataModule
from datamodules.resumable import ResumableSampler
from modules import ImageClassifier
from modules.classifier import NORM_LAYERS
from tests.conftest import fast_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def modern_config() -> dict:
    return yaml.safe_load((CONFIGS / "imagenet_modern.yaml").read_text())


def recipe_model(arch: str = "resnet18", **overrides) -> ImageClassifier:
    """An ImageClassifier with the modern config's schedule, warm-up and weight decay (its lr as the config gives
    it: no linear scaling, which needs a Trainer)."""
    config = modern_config()
    model = config["model"]
    sgd = model["optimizer"]["init_args"]
    cosine = model["lr_scheduler"]
    assert cosine["class_path"] == "torch.optim.lr_scheduler.CosineAnnealingLR"
    keys = ("warmup_epochs", "warmup_interval", "warmup_start_factor", "norm_weight_decay")
    return ImageClassifier(
        arch=arch,
        num_classes=1000,
        in_channels=3,
        optimizer=lambda params: torch.optim.SGD(params, **sgd),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, **cosine["init_args"]),
        **{**{k: model[k] for k in keys}, **overrides},
    )


def torchvision_lrs(lr: float, epochs: int, warmup: int, decay: float = 0.01) -> list[float]:
    """train.py's schedulers on a dummy optimizer, in its order, stepped once per epoch."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - warmup, eta_min=0.0)
    ramp = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=decay, total_iters=warmup)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[ramp, main], milestones=[warmup])
    out = []
    for _ in range(epochs):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return out


def test_the_lr_of_every_epoch_is_torchvisions():
    """600 epochs: 1%, 20.8%, 40.6%, 60.4%, 80.2% of 0.5, then (1 + cos(pi (e - 5) / 595)) / 2 of it, the same for
    both parameter groups, and what torch's LinearLR/CosineAnnealingLR/SequentialLR give torchvision's train.py."""
    config = modern_config()
    epochs, lr = config["trainer"]["max_epochs"], config["model"]["optimizer"]["init_args"]["lr"]
    assert (epochs, config["model"]["lr_scheduler"]["init_args"]["T_max"]) == (600, 595)
    model = recipe_model()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "epoch"  # configs/imagenet.yaml's, which this stacks on
    ours = []
    for _ in range(epochs):
        ours.append([group["lr"] for group in optimizer.param_groups])
        scheduler.step()
    theirs = torchvision_lrs(lr, epochs, 5)
    assert [lrs[0] for lrs in ours] == theirs and all(len(set(lrs)) == 1 for lrs in ours)
    assert [round(x / lr, 6) for x in theirs[:6]] == [0.01, 0.208, 0.406, 0.604, 0.802, 1.0]
    cosine = [lr * (1 + math.cos(math.pi * (e - 5) / 595)) / 2 for e in range(5, epochs)]
    assert theirs[5:] == pytest.approx(cosine, rel=1e-9, abs=1e-12)
    assert theirs[6] / lr == pytest.approx(0.99999303, abs=1e-8) and theirs[599] / lr == pytest.approx(6.97e-6, 1e-2)


def test_the_per_step_ramp_stays_an_option():
    """``warmup_interval: step`` (the default, and today's): no warm-up scheduler, the ramp scales each step's lr."""
    model = recipe_model(warmup_interval="step")
    scheduler = model.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)


def torchvision_set_weight_decay(model: torch.nn.Module, weight_decay: float, norm_weight_decay: float | None):
    """utils.py's ``set_weight_decay`` without custom keys (the recipe gives none): its groups, in its order."""
    params: dict[str, list] = {"other": [], "norm": []}
    decays = {"other": weight_decay, "norm": norm_weight_decay}

    def _add_params(module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                continue
            if norm_weight_decay is not None and isinstance(module, NORM_LAYERS):
                params["norm"].append(p)
            else:
                params["other"].append(p)
        for child in module.children():
            _add_params(child)

    _add_params(model)
    return [{"params": params[k], "weight_decay": decays[k]} for k in params if params[k]]


def test_the_weight_decay_of_every_resnet50_parameter_is_torchvisions():
    """ResNet-50 (on the meta device): every BatchNorm weight and bias 0, every other parameter 2e-5, fc.bias
    included, in the groups and order torchvision's ``set_weight_decay(norm_weight_decay=0.0)`` gives."""
    with torch.device("meta"):
        model = recipe_model("resnet50")
    ours = model.configure_optimizers()["optimizer"].param_groups
    theirs = torchvision_set_weight_decay(model.net, 2e-5, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}

    def decay_of(groups: list[dict]) -> dict[str, float]:
        return {names[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}

    assert decay_of(ours) == decay_of(theirs) and len(decay_of(ours)) == len(names) == 161
    assert [[names[id(p)] for p in g["params"]] for g in ours] == [[names[id(p)] for p in g["params"]] for g in theirs]
    decay = decay_of(ours)
    assert decay["net.fc.bias"] == decay["net.fc.weight"] == decay["net.conv1.weight"] == 2e-5
    assert decay["net.bn1.weight"] == decay["net.layer4.2.bn3.bias"] == 0.0


class TorchvisionRASampler:
    """sampler.py's ``RASampler`` (shuffled), as it draws its indices."""

    def __init__(self, size: int, num_replicas: int, rank: int, seed: int, repetitions: int) -> None:
        self.size, self.num_replicas, self.rank, self.seed, self.repetitions = (
            size,
            num_replicas,
            rank,
            seed,
            repetitions,
        )
        self.num_samples = int(math.ceil(size * float(repetitions) / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected_samples = int(math.floor(size // 256 * 256 / num_replicas))
        self.epoch = 0

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        indices = torch.randperm(self.size, generator=g).tolist()
        indices = [ele for ele in indices for i in range(self.repetitions)]
        indices += indices[: (self.total_size - len(indices))]
        indices = indices[self.rank : self.total_size : self.num_replicas]
        return iter(indices[: self.num_selected_samples])


@pytest.mark.parametrize(("size", "world"), [(1000, 1), (1000, 8), (1283, 3), (257, 2)])
def test_repeated_augmentation_draws_torchvisions_indices(size, world):
    """Each rank's samples, epoch by epoch, are RASampler's (4 repetitions): floor(size / 256) x 256 over all ranks."""
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableSampler(range(size), num_replicas=world, rank=rank, seed=7, repeats=4)
            theirs = TorchvisionRASampler(size, world, rank, seed=7, repetitions=4)
            ours.set_epoch(epoch)
            theirs.epoch = epoch
            assert [p // 4 for p in ours] == list(theirs)
            assert len(ours) == size // 256 * 256 // world


def test_the_average_updates_at_the_epochs_steps_and_copies_the_weights_during_the_warm_up(mnist_dir, tmp_path):
    """MNIST, 2 epochs of 5 steps, 1 warm-up epoch, an update every 2 steps: the lr is 1% of its value in epoch 0 and
    all of it in epoch 1 (stepped per epoch through SequentialLR); the average updates at the steps 0, 2, 4 of each
    epoch (3 in epoch 1, where Lightning's rule of every 2nd step of the run would make 2), restarting at each update
    of epoch 0; its decay is torchvision's for 1 process x 32 images, 2 updates apart, over 2 epochs."""
    lrs: list[float] = []

    class Lrs(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    model = ImageClassifier(
        arch="mnist_cnn", optimizer=lambda p: torch.optim.SGD(p, lr=0.1), warmup_epochs=1, warmup_interval="epoch",
        lr_scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100),
    )  # fmt: skip
    ema = EMA(torchvision_decay=0.99998, update_every_n_steps=2)
    trainer = fast_trainer(
        tmp_path, callbacks=[ema, Lrs()], max_epochs=2, limit_train_batches=5, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=MNISTDataModule(data_dir=str(mnist_dir), batch_size=32, num_workers=0))
    assert lrs == pytest.approx([0.001] * 5 + [0.1] * 5)
    assert int(ema._average_model.n_averaged) == 3
    assert ema.effective_decay == torchvision_adjusted(0.99998, 32, 2, 2) == pytest.approx(1 - 2e-5 * 32 * 2 / 2)
    assert torchvision_adjusted(0.99998, 8 * 128, 32, 600) == pytest.approx(0.99890773, abs=1e-8)
    assert torchvision_adjusted(0.99998, 1 * 128, 32, 600) == pytest.approx(0.99986347, abs=1e-8)


def test_norm_only_and_norm_and_bias_decay_are_one_choice_and_epoch_warmup_needs_whole_epochs():
    from core.errors import UserError

    with pytest.raises(UserError, match="give one"):
        recipe_model(norm_bias_weight_decay=0.0).configure_optimizers()
    with pytest.raises(UserError, match="whole model.warmup_epochs"):
        recipe_model(warmup_epochs=2.5).configure_optimizers()
