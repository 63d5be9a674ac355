import torch
import torch.nn.functional as F
from torch import nn


class TutorialNet(nn.Module):
    """The ``Net`` of the PyTorch tutorial "Writing Distributed Applications with PyTorch" (its synchronous SGD
    example), for 28x28 input. It returns logits: the tutorial's ``log_softmax`` + ``nll_loss`` is the classifier's
    ``cross_entropy`` on them, the same loss and gradients.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return self.fc2(x)


def tutorial_net(num_classes: int = 10, in_channels: int = 1) -> TutorialNet:
    """The distributed tutorial's two-convolution network (10 and 20 channels of 5x5, 21,840 parameters)."""
    return TutorialNet(num_classes, in_channels)
