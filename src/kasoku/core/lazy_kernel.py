"""Triton kernels defined on first use (``import triton`` costs ~0.2 s), once for the GPU and
once for Triton's interpreter (``TRITON_INTERPRET=1``: kernels run on the CPU, slowly, for
tests), since Triton reads that switch when a kernel is defined."""
from __future__ import annotations

import os
import threading
from typing import Callable


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """``kernel()``: the kernel ``define()`` returns, defined once per interpreter mode."""

    def __init__(self, define: Callable[[], object]):
        self._define, self._kernels, self._lock = define, {}, threading.Lock()

    def __call__(self):
        with self._lock:
            mode = interpreting()
            kernel = self._kernels.get(mode)
            if kernel is None:
                kernel = self._kernels[mode] = self._define()
            return kernel
