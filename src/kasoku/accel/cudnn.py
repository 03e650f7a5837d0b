"""cuDNN autotuning (seed 004): ``torch.backends.cudnn.benchmark`` times the available
convolution algorithms for each new input shape and keeps the fastest. The timing happens in
the first steps, which a benchmark counts as warm-up."""
from __future__ import annotations

import torch

from kasoku.accel.notes import skip


def apply_cudnn_benchmark(enabled: bool, device, notes: list[str] | None = None) -> bool:
    """Set ``cudnn.benchmark`` to ``enabled`` on CUDA (off too: the flag is global); returns
    whether autotuning is on. On another device a request is warned about once, noted, and has
    no effect."""
    device = torch.device(device)
    if device.type != "cuda":
        if enabled:
            skip(notes, f"cudnn_benchmark: no effect on {device.type} (cuDNN is CUDA's library)")
        return False
    torch.backends.cudnn.benchmark = bool(enabled)
    return torch.backends.cudnn.benchmark
