"""K-FAC's cost in ``kasoku profile``: its phases (``KFAC.phases``: the factors, the
inverses, the preconditioning) against the rest of the step, measured over a window that
holds each kind of K-FAC step at its rate.

K-FAC's steps are not alike: factor steps (every ``factor_update_freq`` steps) add the factors'
products, inverse steps (every ``inv_update_freq``) their eigendecompositions, which can take
longer than many plain steps together. A mean over a window that holds no inverse step, or two
in ten steps where the run has one, is not the run's. So ``kasoku profile`` rounds its measured
window up to whole cycles (``measured_steps``: a multiple of ``KFAC.cycle_steps``, the least
common multiple of the two intervals: any window of whole cycles holds each kind of step at its
rate, wherever it starts), and times every step of it (``every_step_clock``): the always-on
clock's sample of one step in 16 on a GPU would hold an inverse step or not by chance. A timed
step costs tens of microseconds of host time on a GPU (``PhaseClock.CUDA_SAMPLE_EVERY``), in
the measured throughput too.

The step without K-FAC's phases is its base optimizer's step on the same batch (``update`` is
the base optimizer's own step): what the same run would take per step with that optimizer
alone, less whatever else K-FAC's hooks cost (read it as an estimate; ``--confirm`` measures the
base optimizer's run itself).
"""
from __future__ import annotations

from kasoku.core.phases import PhaseClock

_WORDS = {"kfac_factors": "factors", "kfac_inverse": "inverse",
          "kfac_precondition": "preconditioning"}


def cycle_steps(optimizer) -> int:
    """The steps after which ``optimizer``'s schedule repeats (``KFAC.cycle_steps``); 1 for an
    optimizer whose steps are all alike."""
    return int(getattr(optimizer, "cycle_steps", 1) or 1)


def measured_steps(steps: int, cycle: int) -> int:
    """``steps`` rounded up to whole cycles of ``cycle`` steps."""
    return -(-steps // cycle) * cycle


def every_step_clock(device) -> PhaseClock:
    """A phase clock that times every step (no sampling)."""
    return PhaseClock(device, sample_every=1, sample_period_s=0.0)


def kfac_figures(phases: dict, optimizer, steps: int | None = None) -> dict:
    """``{"kfac": {...}, "kfac_pct": % of the step}`` from ``phases`` (``PhaseClock.take``'s
    dict) of a K-FAC ``optimizer`` (``kasoku.kfac.KFAC``: the caller tells; its ``phases`` are
    the ones read), ``{}`` when the phases hold no step. ``kfac``: ``ms_per_step`` and ``pct`` (all
    its phases), ``phases_ms`` and ``phases_pct`` (each), ``step_ms``, ``without_ms`` (the
    step less K-FAC's phases), ``ratio`` (the step over that), its settings (``base``,
    ``method``, ``factor_update_freq``, ``inv_update_freq``, ``cycle_steps``) and ``steps``
    (the steps measured)."""
    if "time/step" not in phases:
        return {}
    step_ms = phases["time/step"]
    phases_ms = {p: phases.get(f"time/{p}", 0.0) for p in optimizer.phases}
    phases_pct = {p: phases.get(f"time/{p}%", 0.0) for p in optimizer.phases}
    total_ms = sum(phases_ms.values())
    without_ms = step_ms - total_ms
    c = optimizer.config
    kfac = {"ms_per_step": total_ms, "pct": sum(phases_pct.values()),
            "phases_ms": phases_ms, "phases_pct": phases_pct, "step_ms": step_ms,
            "without_ms": without_ms,
            "ratio": step_ms / without_ms if without_ms > 0 else None,
            "base": c.base, "method": c.method, "factor_update_freq": c.factor_update_freq,
            "inv_update_freq": c.inv_update_freq, "cycle_steps": optimizer.cycle_steps,
            "steps": steps}
    return {"kfac": kfac, "kfac_pct": kfac["pct"]}


def ms(x: float) -> str:
    """Milliseconds to three figures, without an exponent (1553, not 1.55e+03)."""
    return f"{x:.3g}" if abs(x) < 999.5 else f"{x:.0f}"


def format_kfac(k: dict) -> str:
    """One line: ``K-FAC: 41 of the 102 ms step (40%): factors 5.1 + inverse 30 + ...``."""
    parts = " + ".join(f"{_WORDS[p]} {ms(t)}" for p, t in k["phases_ms"].items())
    ratio = f", x{k['ratio']:.2f}" if k.get("ratio") else ""
    steps = f"; {k['steps']} steps measured" if k.get("steps") else ""
    return (f"K-FAC: {ms(k['ms_per_step'])} of the {ms(k['step_ms'])} ms step "
            f"({k['pct']:.0f}%) = {parts} ms; the step without them {ms(k['without_ms'])} ms "
            f"(its base optimizer, {k['base']}){ratio} (factors every {k['factor_update_freq']} "
            f"steps, inverses every {k['inv_update_freq']}, method {k['method']}{steps}, "
            f"whole cycles of {k['cycle_steps']})")
