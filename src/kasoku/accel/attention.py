"""Which kernel ``scaled_dot_product_attention`` runs: PyTorch picks one per call (flash,
memory-efficient, cuDNN, or the math fallback) by the inputs and the device, in an order of its
own (torch's default order puts cuDNN's kernel after the math fallback, so it runs only where
asked for); ``sdpa_backend`` pins it with ``torch.nn.attention.sdpa_kernel`` so the ladder can
measure each.

It is a lever of the step, not a setting of the model: the same weights and the same state
dict, the same mathematics up to rounding, and any model that calls
``scaled_dot_product_attention`` (a user's workload too) is pinned alike; the plain
attention (``gpt:attention=plain``) calls no such kernel. The whole step runs inside the
context: the backward kernel is the one that pairs with the forward's.
"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kasoku.accel.config import SDPA_BACKENDS
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.train.step import Step, StepWrapper

_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
CUDA_ONLY = ("efficient", "cudnn")
"""The backends with no CPU kernel."""


def check_sdpa_backend(backend: str, device) -> None:
    """Refuse, in one line, a backend this device has no kernel for."""
    device = torch.device(device)
    if backend not in SDPA_BACKENDS:
        raise ConfigError(f"unknown sdpa backend {backend!r}; choose one of "
                          f"{', '.join(SDPA_BACKENDS)}")
    if backend in CUDA_ONLY and device.type != "cuda":
        kernel = {"efficient": "the memory-efficient attention kernel",
                  "cudnn": "cuDNN's attention kernel"}[backend]
        raise ConfigError(f"{flag('accel.sdpa_backend')} {backend}: {kernel} is CUDA's; on "
                          f"{device.type} use auto, flash (PyTorch's CPU flash kernel) or math")
    if backend in ("flash", "cudnn") and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (8, 0):
        name = {"flash": "FlashAttention", "cudnn": "cuDNN's attention"}[backend]
        raise ConfigError(f"{flag('accel.sdpa_backend')} {backend}: {name} needs compute "
                          "capability 8.0 (A100) or newer, this GPU has "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; use "
                          "efficient")


class PinnedAttention(StepWrapper):
    """The step under ``sdpa_kernel(backend)``: forward, backward and update. Its inner step
    runs eagerly: phase marks reach it."""

    def __init__(self, step_fn: Step, backend: str):
        super().__init__(step_fn)
        self.backend = backend
        self.kernel = _KERNELS[backend]

    def __call__(self, *args, **kwargs):
        with sdpa_kernel(self.kernel):
            return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PinnedAttention({self.inner!r}, {self.backend!r})"


def apply_sdpa_backend(step_fn: Step, backend: str, device) -> Step:
    """``step_fn`` with every ``scaled_dot_product_attention`` of its steps pinned to
    ``backend`` (auto: PyTorch's choice, the step unchanged). Refuses a backend the device
    cannot run (``check_sdpa_backend``)."""
    check_sdpa_backend(backend, device)
    return step_fn if backend == "auto" else PinnedAttention(step_fn, backend)
