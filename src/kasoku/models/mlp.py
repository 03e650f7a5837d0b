"""Multi-layer perceptron of seed 001 (Chainer's MNIST example): 784-1000-1000-10, ReLU."""
from __future__ import annotations

import torch
from torch import nn

from kasoku.models._init import lecun_normal_


class MLP(nn.Module):
    """``depth`` hidden Linear-ReLU layers of width ``hidden``, then a Linear to
    ``out_features`` logits. The input is flattened from dimension 1, so ``[B, 1, 28, 28]``
    images and ``[B, 784]`` vectors both work. Weights are LeCun-normal (Chainer's default)."""

    def __init__(self, in_features: int = 784, hidden: int = 1000, out_features: int = 10,
                 depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLP depth is the number of hidden layers and must be >= 1, "
                             f"got {depth}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)
        lecun_normal_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
