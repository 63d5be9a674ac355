import pytest
import torch
from torch import nn

from modules import zoo


def test_mnist_cnn_is_the_pytorch_example_network():
    net = zoo.build("mnist_cnn", num_classes=10, in_channels=1)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 32), (32, 64)]
    assert net(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    assert sum(p.numel() for p in net.parameters()) == 1_199_882


def test_mnist_fast_is_the_small_batchnorm_default():
    net = zoo.build("mnist_fast", num_classes=10, in_channels=1)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 16), (16, 32), (32, 64)]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 3
    assert net(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    assert sum(p.numel() for p in net.parameters()) < 30_000  # ~40x fewer than mnist_cnn
    assert zoo.build("mnist_fast", num_classes=3, in_channels=3)(torch.randn(2, 3, 28, 28)).shape == (2, 3)


def test_tutorial_net_is_the_distributed_tutorials_network():
    net = zoo.build("tutorial_net", num_classes=10, in_channels=1)
    convs = [(m.in_channels, m.out_channels, m.kernel_size) for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert convs == [(1, 10, (5, 5)), (10, 20, (5, 5))]
    linears = [(m.in_features, m.out_features) for m in net.modules() if isinstance(m, nn.Linear)]
    assert linears == [(320, 50), (50, 10)]
    assert sum(isinstance(m, nn.Dropout2d) for m in net.modules()) == 1
    assert sum(p.numel() for p in net.parameters()) == 21_840
    net.eval()
    logits = net(torch.randn(4, 1, 28, 28))  # logits: the tutorial's log_softmax is cross_entropy's first step
    assert logits.shape == (4, 10) and not torch.allclose(logits.exp().sum(1), torch.ones(4))


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small", "vit_b_16"])
def test_torchvision_models_take_grayscale(arch):
    net = zoo.build(arch, num_classes=7, in_channels=1)
    first_conv = next(m for m in net.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    size = 224 if arch.startswith("vit") else 64
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(1, 1, size, size)).shape == (1, 7)


def test_rgb_models_keep_their_first_conv():
    net = zoo.build("resnet18", num_classes=5, in_channels=3)
    assert net.conv1.in_channels == 3 and net.fc.out_features == 5


def test_every_classification_architecture_is_listed():
    names = zoo.available()
    for arch in ("mnist_cnn", "resnet18", "resnet50", "alexnet", "vgg16", "vit_b_16", "efficientnet_b0"):
        assert arch in names
    assert "fasterrcnn_resnet50_fpn" not in names  # detection models are not classifiers


def test_unknown_arch_lists_the_valid_names():
    with pytest.raises(ValueError, match="Unknown model.arch 'resnet51'") as err:
        zoo.build("resnet51", num_classes=10)
    assert "resnet50" in str(err.value) and "mnist_cnn" in str(err.value)
