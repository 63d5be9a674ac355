from torch import nn


def _conv_bn_relu(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU()]


def mnist_fast(num_classes: int = 10, in_channels: int = 1, width: int = 16) -> nn.Sequential:
    """A small BatchNorm CNN for 28x28 input: the default MNIST network, about 6x cheaper than ``mnist_cnn``.

    Three 3x3 conv-BN-ReLU blocks of ``width``, 2x and 4x ``width`` channels, each followed by 2x2 max pooling
    (28 -> 14 -> 7 -> 3), then one linear layer. With ``width`` 16: 1.9 M multiply-adds and 29 k parameters per
    image (``mnist_cnn``: 12 M and 1.2 M); with BatchNorm it trains to 99% test accuracy in about two epochs.
    """
    return nn.Sequential(
        *_conv_bn_relu(in_channels, width),
        nn.MaxPool2d(2),
        *_conv_bn_relu(width, 2 * width),
        nn.MaxPool2d(2),
        *_conv_bn_relu(2 * width, 4 * width),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * width * 3 * 3, num_classes),
    )
