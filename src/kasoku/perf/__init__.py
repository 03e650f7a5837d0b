"""Performance arithmetic: model FLOPs counted per training step, matmul peaks measured on this
device, MFU, and the environment a figure was measured in.

The names below are imported on first use (PEP 562): the torch-free modules (``noise``,
``cpuinfo``...) load without torch."""
from __future__ import annotations

from kasoku.core.lazy_exports import lazy_exports

__all__ = ["StepFlops", "count_step_flops", "compute_mfu", "PEAK_DTYPES", "PeakResult",
           "measure_matmul_peak"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "StepFlops": "kasoku.perf.flops", "count_step_flops": "kasoku.perf.flops",
    "compute_mfu": "kasoku.perf.mfu", "PEAK_DTYPES": "kasoku.perf.peak",
    "PeakResult": "kasoku.perf.peak", "measure_matmul_peak": "kasoku.perf.peak"})
