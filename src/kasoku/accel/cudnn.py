"""cuDNN autotuning (seed 004): ``torch.backends.cudnn.benchmark`` times the available
convolution algorithms for each new input shape and keeps the fastest. The timing happens in
the first steps, which a benchmark counts as warm-up."""
from __future__ import annotations

import torch

from kasoku.accel.notes import skip


def apply_cudnn_benchmark(cfg, device, notes: list[str] | None = None) -> bool:
    """Set ``cudnn.benchmark`` to ``cfg.cudnn_benchmark`` on CUDA; returns whether autotuning is
    on. On another device the request is warned about once, noted, and has no effect."""
    device = torch.device(device)
    if device.type != "cuda":
        if cfg.cudnn_benchmark:
            skip(notes, f"cudnn_benchmark: no effect on {device.type} (cuDNN is CUDA's library)")
        return False
    torch.backends.cudnn.benchmark = bool(cfg.cudnn_benchmark)
    return torch.backends.cudnn.benchmark
