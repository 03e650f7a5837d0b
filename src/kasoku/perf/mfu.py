"""Model FLOPs utilization: counted model FLOPs per second over a peak measured on this device
for the dtype the model's products run in.

The dtype rule (which peak a configuration is measured against):
fp32 with TF32 off -> the fp32 peak; tf32 -> the TF32 peak; autocast bf16/fp16 (and pure fp16)
-> the bf16/fp16 peak, because autocast runs every matrix product and convolution, i.e. every
counted FLOP, in that dtype. CPU fp32 -> the CPU fp32 peak.

MFU is withheld (None plus the reason) where the number would mislead: no FLOPs were counted,
the peak could not be measured, or the result exceeds 1, which means the products did not run
in the probed dtype (or the probe did not reach this device's peak).
"""
from __future__ import annotations


def compute_mfu(flops_per_step: float | None, step_time_s: float | None,
                peak_flops_per_s: float | None, peak_dtype: str | None = None
                ) -> tuple[float | None, str]:
    """``(mfu, note)``: ``mfu = flops_per_step / step_time_s / peak_flops_per_s``, or None and
    the reason it is withheld."""
    if not flops_per_step:
        return None, "N/A: no matrix-product or convolution FLOPs were counted for this model"
    if not step_time_s or step_time_s <= 0:
        return None, "N/A: no measured step time"
    if not peak_flops_per_s or peak_flops_per_s <= 0:
        return None, f"N/A: no measured {peak_dtype or 'matmul'} peak on this device"
    value = flops_per_step / step_time_s / peak_flops_per_s
    if value > 1.0:
        return None, (f"N/A: {value:.2f} of the measured {peak_dtype} peak; the products did "
                      "not run in that dtype, so the ratio would mislead")
    return value, f"counted model FLOPs / measured {peak_dtype} matmul peak"
