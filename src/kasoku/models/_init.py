"""Weight initialisation shared by the seed-001 models."""
from __future__ import annotations

from torch import nn


def lecun_normal_(module: nn.Module) -> None:
    """Chainer's default for ``L.Linear`` and ``L.Convolution2D``: weights ~ N(0, 1/fan_in),
    biases zero. Seed 001's figures were produced with it, and the sigmoid LeNet5 is sensitive
    to the weight scale (PyTorch's default draws ~1/sqrt(3) of that spread)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="linear")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
