"""The device a command runs on: ``--device auto|cpu|cuda|cuda:N``, the same in every command."""
from __future__ import annotations

import torch

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

AUTO = "auto"


def resolve_device(spec: str | torch.device | None = AUTO, need_it: bool = True
                   ) -> torch.device:
    """``auto`` (or None): cuda when this PyTorch sees a CUDA device, else cpu; ``cpu``,
    ``cuda`` or ``cuda:N`` as given. ``need_it``: refuse a CUDA device this machine does not
    have (``ConfigError`` saying what to use); False for commands that only read results."""
    if spec is None or spec == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and need_it:
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag('train.device')} {spec}: this PyTorch sees no CUDA device "
                              f"(torch {torch.__version__}); use {flag('train.device')} cpu (or "
                              "auto)")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"{flag('train.device')} {spec}: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return device
