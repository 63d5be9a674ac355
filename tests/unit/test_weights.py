"""Pretrained weights (``--model.weights``): torchvision names read from a local torch hub cache (no network), files
of state dicts and of this app's checkpoints, the replaced head and the adapted first convolution."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torchvision

from modules import ImageClassifier, zoo
from modules.zoo.weights import WeightsError, cache_path
from tests.conftest import fast_trainer


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    """An empty TORCH_HOME: torch.hub looks for downloaded weights in ``<it>/hub/checkpoints/``."""
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def saved_net(arch: str, path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A randomly initialised torchvision ``arch`` (fixed seed) saved at ``path`` as a state dict: a stand-in for the
    published file, made here."""
    torch.manual_seed(seed)
    state = torchvision.models.get_model(arch).state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def shares_no_row(new: torch.Tensor, pretrained: torch.Tensor) -> bool:
    """True when no row of the new head's weight is a row of the pretrained head's (a new layer, not a copy)."""
    return not (new[:, None] == pretrained[None]).all(dim=-1).any()


@pytest.fixture
def info_logs(caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    return caplog


def test_named_weights_load_from_the_cache_with_a_new_head_and_a_grayscale_first_conv(torch_home, info_logs):
    # the exact file torchvision expects for ResNet18_Weights.IMAGENET1K_V1
    state = saved_net("resnet18", torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    net = zoo.build("resnet18", num_classes=10, in_channels=1, weights="IMAGENET1K_V1")
    loaded = net.state_dict()
    for key, value in state.items():
        if not key.startswith(("fc.", "conv1.")):
            assert torch.equal(loaded[key], value), key
    # MNIST's 10 classes: a new head; grayscale: the RGB kernels summed into one input channel
    assert loaded["fc.weight"].shape == (10, 512) and loaded["fc.bias"].shape == (10,)
    assert shares_no_row(loaded["fc.weight"], state["fc.weight"]), "the new head copies pretrained rows"
    assert loaded["conv1.weight"].shape == (64, 1, 7, 7)
    torch.testing.assert_close(loaded["conv1.weight"], state["conv1.weight"].sum(dim=1, keepdim=True))
    # so a gray image gives the first convolution's activations of its RGB copy
    gray = torch.rand(2, 1, 32, 32)
    rgb_conv = torchvision.models.resnet18().conv1
    rgb_conv.load_state_dict({"weight": state["conv1.weight"]})
    torch.testing.assert_close(net.conv1(gray), rgb_conv(gray.expand(-1, 3, -1, -1)), rtol=1e-5, atol=1e-5)
    assert "classifier head fc replaced, 1000 -> 10 classes" in info_logs.text
    assert "first convolution conv1 adapted from 3 to 1 input channels, the pretrained kernels summed" in info_logs.text


def test_default_is_the_recommended_weights_and_the_class_prefix_is_accepted(torch_home):
    weights = torchvision.models.ResNet18_Weights.DEFAULT
    state = saved_net("resnet18", cache_path(weights), seed=1)
    for name in ("DEFAULT", "ResNet18_Weights.IMAGENET1K_V1"):
        net = zoo.build("resnet18", num_classes=1000, in_channels=3, weights=name)  # ImageNet: nothing replaced
        assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())


def test_classifier_sequential_head_is_replaced(torch_home, info_logs):
    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    state = saved_net("mobilenet_v3_small", cache_path(weights))
    net = zoo.build("mobilenet_v3_small", num_classes=100, in_channels=3, weights="IMAGENET1K_V1")
    assert net.classifier[-1].out_features == 100
    torch.testing.assert_close(net.classifier[0].weight, state["classifier.0.weight"])
    assert "classifier head classifier.3 replaced, 1000 -> 100 classes" in info_logs.text


@pytest.mark.parametrize(
    ("arch", "head"),
    [("resnet50", "fc"), ("vgg16", "classifier.6"), ("vit_b_16", "heads.head"), ("efficientnet_b0", "classifier.1"),
     ("convnext_tiny", "classifier.2"), ("densenet121", "classifier"), ("swin_t", "head"),
     ("squeezenet1_0", "classifier.1")],
)  # fmt: skip
def test_the_head_of_each_common_family(arch, head):
    with torch.device("meta"):  # shapes only: nothing allocated
        assert zoo.head(torchvision.models.get_model(arch))[0] == head


def test_unknown_name_lists_the_valid_names_of_the_arch():
    with pytest.raises(WeightsError) as err:
        zoo.build("resnet50", num_classes=10, weights="IMAGENET1K_V3")
    message = str(err.value)
    assert "Unknown model.weights 'IMAGENET1K_V3' for resnet50" in message
    assert "Valid names for resnet50: IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT" in message
    with pytest.raises(WeightsError, match="mnist_cnn has no torchvision weights names"):
        zoo.build("mnist_cnn", num_classes=10, weights="DEFAULT")


def test_state_dict_file_of_another_class_count(tmp_path, info_logs):
    path = tmp_path / "imagenet_resnet18.pth"
    state = saved_net("resnet18", path)
    net = zoo.build("resnet18", num_classes=100, in_channels=3, weights=str(path))
    assert net.fc.out_features == 100 and torch.equal(net.layer4[1].conv2.weight, state["layer4.1.conv2.weight"])
    assert shares_no_row(net.fc.weight.detach(), state["fc.weight"]), "the new head copies pretrained rows"
    assert "1000 -> 100 classes" in info_logs.text


def test_checkpoint_of_this_app_is_a_weights_file(mnist_dir, tmp_path):
    from datamodules import MNISTDataModule

    model = ImageClassifier(arch="mnist_fast", num_classes=10, in_channels=1)
    trainer = fast_trainer(tmp_path, limit_train_batches=2, limit_val_batches=0)
    trainer.fit(model, datamodule=MNISTDataModule(data_dir=str(mnist_dir), batch_size=8))
    trainer.save_checkpoint(tmp_path / "mnist.ckpt")
    # fine-tuned onto 5 classes of RGB images: every layer but the head and the first convolution as trained
    net = zoo.build("mnist_fast", num_classes=5, in_channels=3, weights=str(tmp_path / "mnist.ckpt"))
    trained, head = model.net.state_dict(), zoo.head(net)[0]
    assert head == "13"  # the Linear after the flatten
    for key, value in net.state_dict().items():
        if key.startswith(f"{head}."):  # replaced by a new layer, not the trained head's first rows
            assert value.shape[0] == 5 and shares_no_row(value.reshape(5, -1), trained[key].reshape(10, -1)), key
        elif key == "0.weight":  # the first convolution, 1 -> 3 channels: the kernel divided by 3 on each
            torch.testing.assert_close(value, (trained[key] / 3).expand(-1, 3, -1, -1))
        else:
            assert torch.equal(value, trained[key]), key


def test_file_of_another_network_or_missing_is_one_line(tmp_path):
    path = tmp_path / "resnet18.pth"
    saved_net("resnet18", path)
    with pytest.raises(WeightsError, match=r"does not hold resnet34 weights \(missing: layer1.2.bn1.bias"):
        zoo.build("resnet34", num_classes=10, in_channels=3, weights=str(path))
    with pytest.raises(WeightsError, match="model.weights file nowhere/w.pth does not exist"):
        zoo.build("resnet18", num_classes=10, weights="nowhere/w.pth")
