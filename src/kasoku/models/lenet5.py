"""LeNet5 exactly as seed 001 trains it on CIFAR-10 (Chainer's LeNet5 example, sigmoid
activations, max-pooling, conv 6/16/120 then fc 84/10)."""
from __future__ import annotations

import torch
from torch import nn

from kasoku.models._init import lecun_normal_


class LeNet5(nn.Module):
    """For a 32x32 input the spatial size goes 32 -conv5-> 28 -pool-> 14 -conv5-> 10 -pool-> 5
    -conv4-> 2, so ``fc4`` sees 120x2x2 = 480 features (what Chainer's ``Linear(None, 84)``
    infers). ``image_size`` lets the same layers run on other square inputs (28 for MNIST
    gives 120x1x1). Always returns logits: the seed's ``softmax`` at evaluation time is dropped
    because the loss (cross-entropy) applies it and argmax accuracy does not change."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2 - 3
        if side < 1:
            raise ValueError(f"LeNet5 needs images of at least 28x28 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.conv3 = nn.Conv2d(16, 120, kernel_size=4)
        self.fc4 = nn.Linear(120 * side * side, 84)
        self.fc5 = nn.Linear(84, num_classes)
        self.pool = nn.MaxPool2d(2, 2)
        lecun_normal_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.sigmoid(self.conv1(x)))
        h = self.pool(torch.sigmoid(self.conv2(h)))
        h = torch.sigmoid(self.conv3(h))
        h = torch.sigmoid(self.fc4(h.flatten(1)))
        return self.fc5(h)
