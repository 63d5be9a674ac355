"""The classic tutorials as configs: ``configs/tutorial_mnist.yaml`` (the PyTorch distributed tutorial's synchronous
SGD) and ``configs/imagenet_apex.yaml`` (NVIDIA Apex's ImageNet example), and the modern ImageNet recipe
(``configs/imagenet_modern.yaml``, torchvision's), each resolved by the real CLI
(``--print_config``, in this process: ``tests/e2e/test_cli_paths.py`` runs it as a command) and run for a few steps
as a user would (the tutorial on 2 gloo processes)."""

from __future__ import annotations

import re

import pytest
import yaml

from app.command import main
from tests.conftest import ROOT, run_cli
from tests.wandb_reader import tensorboard_scalars


def resolved(config: str, capsys: pytest.CaptureFixture) -> dict:
    with pytest.raises(SystemExit) as printed:  # jsonargparse prints the configuration and exits 0
        main(["fit", "--config", str(ROOT / config), "--print_config"])
    assert printed.value.code in (0, None), capsys.readouterr().err[-2000:]
    return yaml.safe_load(capsys.readouterr().out)


def test_tutorial_mnist_resolves_to_the_tutorial_recipe(capsys):
    config = resolved("configs/tutorial_mnist.yaml", capsys)
    trainer, model, data = config["trainer"], config["model"], config["data"]
    assert trainer["strategy"] == "allreduce_per_param"  # average_gradients: one all_reduce per parameter
    assert (trainer["accelerator"], trainer["devices"], trainer["max_epochs"]) == ("cpu", 2, 10)
    assert [c["class_path"] for c in trainer["callbacks"]] == ["app.callbacks.RankEpochLoss"]
    assert all(config["callbacks"].values())  # next to the default callbacks (configs/base.yaml), which stay
    assert model["arch"] == "tutorial_net"
    assert model["optimizer"]["class_path"] == "torch.optim.SGD"
    sgd = model["optimizer"]["init_args"]
    assert (sgd["lr"], sgd["momentum"], sgd["nesterov"], sgd["weight_decay"]) == (0.01, 0.5, False, 0.0)
    assert model["lr_reference_batch_size"] is None and model["lr_scheduler"] is None
    assert model["warmup_epochs"] == 0.0
    assert data["class_path"] == "datamodules.MNISTDataModule" and data["init_args"]["global_batch_size"] == 128


def test_imagenet_apex_resolves_to_the_apex_recipe(capsys):
    config = resolved("configs/imagenet_apex.yaml", capsys)
    trainer, model, data = config["trainer"], config["model"], config["data"]["init_args"]
    assert (trainer["precision"], trainer["benchmark"], trainer["max_epochs"]) == ("16-mixed", True, 90)
    assert model["arch"] == "resnet50" and model["channels_last"] is True
    sgd = model["optimizer"]["init_args"]
    assert (sgd["lr"], sgd["momentum"], sgd["weight_decay"], sgd["nesterov"]) == (0.1, 0.9, 1.0e-4, False)
    assert model["lr_reference_batch_size"] == 256  # lr 0.1 x global batch / 256
    assert model["warmup_epochs"] == 5.0
    scheduler = model["lr_scheduler"]
    assert scheduler["class_path"] == "torch.optim.lr_scheduler.MultiStepLR"
    assert (scheduler["init_args"]["milestones"], scheduler["init_args"]["gamma"]) == ([30, 60, 80], 0.1)
    assert model["lr_scheduler_interval"] == "epoch"
    assert (data["batch_size"], data["image_size"], data["normalize_on_device"]) == (256, 224, True)

    apex = yaml.safe_load((ROOT / "configs/imagenet_apex.yaml").read_text())
    assert "optimizer" not in apex["model"] and "max_epochs" not in apex["trainer"]  # imagenet.yaml's, not restated


def test_imagenet_modern_resolves_to_torchvisions_recipe_and_its_short_variant(capsys):
    """configs/imagenet_modern.yaml alone: torchvision's ResNet-50 recipe on top of the classic one (which it does not
    restate); configs/imagenet_modern_short.yaml: the same on A3's schedule (100 epochs, 160 px)."""
    config = resolved("configs/imagenet_modern.yaml", capsys)
    trainer, model, data = config["trainer"], config["model"], config["data"]["init_args"]
    assert (trainer["max_epochs"], model["arch"], model["warmup_epochs"]) == (600, "resnet50", 5.0)
    sgd = model["optimizer"]["init_args"]
    assert (sgd["lr"], sgd["momentum"], sgd["weight_decay"], model["lr_reference_batch_size"]) == (0.5, 0.9, 2e-5, 1024)
    assert model["lr_scheduler"]["class_path"] == "torch.optim.lr_scheduler.CosineAnnealingLR"
    # torchvision's: the cosine over the 595 epochs after an epoch-wise warm-up from 1%; no decay on norm layers only
    assert model["lr_scheduler"]["init_args"]["T_max"] == 595
    assert (model["warmup_interval"], model["warmup_start_factor"]) == ("epoch", 0.01)
    assert (model["label_smoothing"], model["norm_weight_decay"], model["norm_bias_weight_decay"]) == (0.1, 0.0, None)
    assert config["ema"] | {"decay": None} == {
        "decay": None, "torchvision_decay": 0.99998, "update_every_n_steps": 32, "update_starting_at_step": None
    }  # fmt: skip
    assert (data["batch_size"], data["image_size"], data["eval_image_size"], data["eval_resize_size"]) == (
        128, 176, 224, 232
    )  # fmt: skip
    assert (data["trivial_augment"], data["random_erasing"], data["mixup_alpha"], data["cutmix_alpha"]) == (
        True, 0.1, 0.2, 1.0
    )  # fmt: skip
    assert data["repeated_augmentation"] == 4 and data["decode"] == "auto"  # imagenet.yaml's GPU defaults kept
    modern = yaml.safe_load((ROOT / "configs/imagenet_modern.yaml").read_text())
    assert "arch" not in modern["model"] and "precision" not in modern["trainer"]  # imagenet.yaml's, not restated
    short = resolved("configs/imagenet_modern_short.yaml", capsys)
    assert (short["trainer"]["max_epochs"], short["model"]["lr_scheduler"]["init_args"]["T_max"]) == (100, 95)
    assert (short["data"]["init_args"]["image_size"], short["data"]["init_args"]["eval_image_size"]) == (160, 224)
    assert short["data"]["init_args"]["mixup_alpha"] == 0.2 and short["ema"]["torchvision_decay"] == 0.99998


def test_a_recipe_that_stacks_on_a_missing_file_names_it(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("stacks_on: imagenet_typo.yaml\ndata:\n  class_path: datamodules.ImageNetDataModule\n")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"error: stacks_on: imagenet_typo.yaml in {recipe}: no such file" in err


@pytest.mark.distributed
@pytest.mark.slow
def test_tutorial_mnist_trains_on_two_processes_and_each_rank_prints_its_epoch_loss(mnist_dir, tmp_path):
    result = run_cli(
        "fit", "--config", "configs/tutorial_mnist.yaml", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "2", "--launch.timeout", "120",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--data.data_dir", str(mnist_dir), "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "batch        64 per device, global 128" in output  # the tutorial's bsz = 128 / size on 2 ranks
    assert "AllReduceStrategy" in output
    losses = dict(re.findall(r"^Rank  (\d) , epoch  0 :  ([0-9.]+)$", result.stdout, re.MULTILINE))
    assert sorted(losses) == ["0", "1"], result.stdout[-3000:]
    # each rank's own batches (5 steps from a random start: about ln 10 = 2.3), not a shared average
    assert all(1.0 < float(v) < 3.0 for v in losses.values()) and losses["0"] != losses["1"]
    # train/loss_epoch is over both ranks' batches (the classifier's one all-reduce at the epoch's end): with equal
    # batches on both ranks, the mean of the two ranks' own epoch losses
    (epoch_loss,) = tensorboard_scalars(tmp_path / "version_0")["train/loss_epoch"]
    assert epoch_loss[1] == pytest.approx((float(losses["0"]) + float(losses["1"])) / 2, rel=1e-4)


@pytest.mark.slow
def test_imagenet_apex_runs_a_few_steps_on_cpu(tmp_path):
    # 16-mixed needs a GPU (the preflight refuses it on a CPU): the recipe otherwise as configured, on synthetic
    # images at 64 px, batch 4: lr 0.1 x 4 / 256
    result = run_cli(
        "fit", "--config", "configs/imagenet_apex.yaml", "--trainer.precision", "32-true",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--data.synthetic", "true",
        "--data.batch_size", "4", "--data.image_size", "64", "--data.num_workers", "0",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "learning rate 0.0015625 = 0.1 per 256 images x global batch 4 / 256" in output
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").is_file()
