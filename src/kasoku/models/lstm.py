"""The sine-wave LSTM of seed 001: Linear(1, 5) -> LSTM(5, 5) -> Linear(5, 1) at every step."""
from __future__ import annotations

import torch
from torch import nn


class SineLSTM(nn.Module):
    """Sequence-to-sequence regressor: input ``[B, T, n_input]`` -> output ``[B, T, n_output]``,
    the prediction of the next value at each step. The seed steps a stateful Chainer LSTM one
    value at a time (truncated BPTT); here the whole window is one ``nn.LSTM`` call starting
    from a zero state, which computes the same recurrence with the fused kernel."""

    def __init__(self, n_input: int = 1, n_units: int = 5, n_output: int = 1):
        super().__init__()
        self.l1 = nn.Linear(n_input, n_units)
        self.l2 = nn.LSTM(n_units, n_units, batch_first=True)
        self.l3 = nn.Linear(n_units, n_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.l2(self.l1(x))
        return self.l3(h)
