"""``BatchNormAct2d``: batch norm, an optional residual add and an optional ReLU as one module.

The three are one module so that the three passes over the activation can be replaced by one
kernel pair from outside (a subclass with another forward); the module itself runs them as
PyTorch ops (``nn.BatchNorm2d``, ``+``, ``relu``), which ``torch.compile`` fuses on its own. It
is an ``nn.BatchNorm2d``: the same parameters, buffers and ``state_dict`` keys, so snapshots
load either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormAct2d(nn.BatchNorm2d):
    """``relu(batch_norm(x) + residual)``; ``residual`` optional, ``relu=False`` leaves the
    ReLU out."""

    def __init__(self, num_features: int, relu: bool = True, **kwargs):
        super().__init__(num_features, **kwargs)
        self.relu = relu

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x)
        if residual is not None:
            y = y + residual
        return F.relu(y, inplace=True) if self.relu else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, relu={self.relu}"
