"""The numerics guard: a faster rung must still train the same way. Every rung runs its first
K steps (10 by default) on the same fixed batches from the same initial weights; the mean of
those K losses must lie within a stated relative tolerance of the fp32 reference rung's mean:

    fp32 (and plain): 1%   - the same arithmetic; only summation order may differ
    tf32:             2%   - 10-bit mantissa products, fp32 accumulation
    bf16, fp16 (autocast and pure fp16): 5%

and every loss must be finite. The mean over the K steps, not the loss of step K alone, because
a deep net at its recipe's full learning rate with no warm-up is chaotic in its first steps:
ResNet-152 (CIFAR, bs 32, lr 0.1) swings from 2.3 to 52 and back within 10 steps, and a bf16
rounding difference at step 1 moves the step-10 loss by 4% (step 7: 32%) while the mean moves
by 1%. A rung that breaks training (NaN, overflow, blow-up) misses the mean by far more.

Compilation and CUDA graphs change no arithmetic on purpose, so a compiled rung gets the
tolerance of its precision. The reference itself is checked only for being finite.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TOLERANCES = {"fp32": 0.01, "tf32": 0.02, "bf16": 0.05, "fp16": 0.05, "fp16-pure": 0.05}
DEFAULT_STEPS = 10


@dataclass(frozen=True)
class Verdict:
    status: str
    """"ok", "FAIL" or "n/a" (no reference at this batch size, or the guard is off)."""
    mean_loss: float | None
    reference_mean_loss: float | None
    rel_diff: float | None
    tolerance: float
    steps: int
    reason: str

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def to_dict(self) -> dict:
        return asdict(self)


def check(losses: list[float] | None, reference_losses: list[float] | None, precision: str,
          is_reference: bool = False) -> Verdict:
    """Judge a rung's first-K-step losses against the fp32 reference's at the same batch size."""
    rtol = TOLERANCES[precision]
    if not losses:
        return Verdict("n/a", None, None, None, rtol, 0,
                       "numerics guard off (0 steps) or the run ended before it")
    steps = len(losses)
    bad = [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        return Verdict("FAIL", None, None, None, rtol, steps,
                       f"loss is {losses[bad[0] - 1]} at step {bad[0]}: this rung breaks "
                       "training")
    mean = sum(losses) / steps
    if is_reference:
        return Verdict("ok", mean, mean, 0.0, rtol, steps, "the fp32 reference")
    if not reference_losses or len(reference_losses) != steps \
            or not all(math.isfinite(v) for v in reference_losses):
        return Verdict("n/a", mean, None, None, rtol, steps,
                       "no finite fp32 reference of the same length at this batch size")
    ref = sum(reference_losses) / steps
    rel = abs(mean - ref) / max(abs(ref), 1e-12)
    if rel > rtol:
        return Verdict("FAIL", mean, ref, rel, rtol, steps,
                       f"mean loss of the first {steps} steps {mean:.6g} differs from fp32's "
                       f"{ref:.6g} by {100 * rel:.3g}% (tolerance {100 * rtol:g}%)")
    return Verdict("ok", mean, ref, rel, rtol, steps,
                   f"within {100 * rtol:g}% of fp32 over {steps} steps ({100 * rel:.3f}%)")
