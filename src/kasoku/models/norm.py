"""``BatchNormAct2d``: batch norm, an optional residual add and an optional ReLU as one module.

The three are one module so that one lever (``kasoku.accel.fused_bn``) can replace their
passes over the activation with one kernel pair; by default the module runs them as PyTorch
ops (``nn.BatchNorm2d``, ``+``, ``relu``), which is what the models did before and what
``torch.compile`` fuses on its own. It is an ``nn.BatchNorm2d``: the same parameters, buffers
and ``state_dict`` keys, so snapshots load either way.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormAct2d(nn.BatchNorm2d):
    """``relu(batch_norm(x) + residual)``; ``residual`` optional, ``relu=False`` leaves the
    ReLU out."""

    def __init__(self, num_features: int, relu: bool = True, **kwargs):
        super().__init__(num_features, **kwargs)
        self.relu = relu
        self.fused_forward: Callable | None = None
        """Set by ``kasoku.accel.fused_bn.apply_fused_bn``: the kernels' forward, which
        returns None for a call it cannot take."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused_forward is not None:
            y = self.fused_forward(self, x, residual)
            if y is not None:
                return y
        y = super().forward(x)
        if residual is not None:
            y = y + residual
        return F.relu(y, inplace=True) if self.relu else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, relu={self.relu}"
