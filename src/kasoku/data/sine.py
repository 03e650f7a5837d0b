"""Generated sine-wave windows for the sequence workload (seed 001's LSTM)."""
from __future__ import annotations

import math

import torch

from kasoku.data.base import ArrayDataset

STEP_RAD = 2 * math.pi / 25
"""Phase advance per time step: 25 steps per period, so a 50-step window holds two periods."""


def sine_windows(n: int, seq_len: int = 50, generator: torch.Generator | None = None,
                 noise_std: float = 0.0, name: str = "sine") -> ArrayDataset:
    """``n`` windows of ``sin(phase + STEP_RAD * k)``, ``k = 0..seq_len``, random phase.

    Input ``[seq_len, 1]`` holds steps ``0..seq_len-1`` (plus Gaussian noise of ``noise_std``,
    if any); target ``[seq_len, 1]`` holds the clean value one step later at each position."""
    if n <= 0 or seq_len <= 0:
        raise ValueError(f"sine windows need n >= 1 and seq_len >= 1, got n={n}, "
                         f"seq_len={seq_len}")
    phase = torch.rand(n, 1, generator=generator, dtype=torch.float64) * (2 * math.pi)
    steps = torch.arange(seq_len + 1, dtype=torch.float64) * STEP_RAD
    wave = torch.sin(phase + steps).to(torch.float32).unsqueeze(-1)   # [n, seq_len + 1, 1]
    inputs, targets = wave[:, :-1].clone(), wave[:, 1:].clone()
    if noise_std > 0:
        inputs += noise_std * torch.randn(inputs.shape, generator=generator)
    return ArrayDataset(inputs, targets, name=name)


def sine_datasets(n_train: int = 10000, n_val: int = 1000, seq_len: int = 50, seed: int = 0,
                  noise_std: float = 0.0) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, val)`` sine windows, deterministic in ``seed``. Train and val draw from two
    separate generator streams (``2*seed`` and ``2*seed + 1``), so they never share a window's
    randomness and changing ``n_train`` does not change the validation set."""
    train = sine_windows(n_train, seq_len, torch.Generator().manual_seed(2 * seed),
                         noise_std, name="sine-train")
    val = sine_windows(n_val, seq_len, torch.Generator().manual_seed(2 * seed + 1),
                       noise_std, name="sine-val")
    return train, val
