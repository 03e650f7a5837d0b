"""Performance arithmetic: model FLOPs counted per training step, matmul peaks measured on this
device, MFU, and the environment a figure was measured in."""
from kasoku.perf.flops import StepFlops, count_step_flops
from kasoku.perf.mfu import compute_mfu
from kasoku.perf.peak import PEAK_DTYPES, PeakResult, measure_matmul_peak

__all__ = ["StepFlops", "count_step_flops", "compute_mfu", "PEAK_DTYPES", "PeakResult",
           "measure_matmul_peak"]
