from torch import nn


def mnist_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """The two-convolution network of the PyTorch MNIST example (pytorch/examples mnist/main.py), for 28x28 input."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(9216, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, num_classes),
    )
