"""The figures of a profiled window of steps, typed: what ``trace.analyse`` measured of its
trace, the machine's facts (``window.machine_facts``), the run's context, the window's own
(peak memory, recompilations) and the shares of the step restated for the run without the
profiler (``restated``). ``Window.analyse`` fills them in one place; the advisor
(``kasoku.advisor``) reads them.

A figure not measured (a GPU's busy share on a CPU, the card's memory of a script's CPU run)
is None here and absent from ``to_dict``, which is ``profile.json``'s ``figures``: the same
keys, values and order as the window measured them (``from_dict`` reads one back). The figures
no rule reads (the top kernels, the phases, the peak's provenance, the run's config as saved)
ride along in ``rest``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class StepFigures:
    device: str | None = None
    """``cuda`` (the trace has device rows) or ``cpu``."""
    step_ms: float | None = None
    busy_pct: float | None = None
    """% of the step the device runs kernels, copies or fills (a GPU's)."""
    device_ms: float | None = None
    idle_data_pct: float | None = None
    idle_host_pct: float | None = None
    """% of the step the device waits for the host to launch its work."""
    idle_other_pct: float | None = None
    data_pct: float | None = None
    """% of the step spent waiting for the batch."""
    host_ms: float | None = None
    kernels_per_step: float | None = None
    launches_per_step: float | None = None
    by_kind_ms: dict | None = None
    by_kind_pct: dict | None = None
    by_class_ms: dict | None = None
    """A GPU step's kernel time per ``kernels.KERNEL_CLASSES`` entry (ms per step): what each
    class of work takes, each against its own limit."""
    roofline: dict | None = None
    """Each kernel class's distance to its measured limit (``roofline.roofline``): a GPU
    step's, where its work step was profiled."""
    comm_pct: float | None = None
    attention_ms: dict | None = None
    """``{"fused": ms, "softmax": ms}`` per step (``kernels.attention_kind``)."""
    h2d_ms: float | None = None
    h2d_pageable: bool | None = None
    operator_ms: float | None = None
    """A CPU's: the operators' self time per step."""
    operator_pct: float | None = None
    ops_per_step: float | None = None
    samples_per_step: int | None = None
    threads: int | None = None
    card_gib: float | None = None
    cpu_bf16: bool | None = None
    cpu_bf16_isa: str | None = None
    loader: str | None = None
    """The loader spec (``--loader``), ``serial`` where a script's DataLoader has no workers."""
    batch_size: int | None = None
    has_conv: bool | None = None
    """Whether the model has 2-d convolutions; None where unknown (a script's, before its
    forward is seen)."""
    has_blocks: bool | None = None
    sharded: bool | None = None
    data_kind: str | None = None
    """``in-memory``, ``image-folder``, ... (``data.registry.dataset_kind``)."""
    mfu: float | None = None
    peak_fraction: float | None = None
    """A CPU's step against its measured matmul peak (its MFU)."""
    peak_dtype: str | None = None
    kfac: dict | None = None
    """K-FAC's share of the step (``kfac_cost.kfac_figures``)."""
    kfac_pct: float | None = None
    allreduce_dtype: str | None = None
    mem_peak_gib: float | None = None
    profiled: dict | None = None
    """The shares as the profiled steps measured them, before ``restated``."""
    rest: dict = field(default_factory=dict)
    """The figures no rule reads, as saved."""
    order: tuple[str, ...] = ()
    """The figures measured, in the order ``profile.json`` lists them."""

    @classmethod
    def from_dict(cls, d: dict) -> "StepFigures":
        """Figures as ``profile.json`` holds them (``to_dict``), or as measured."""
        typed = {k: v for k, v in d.items() if k in TYPED}
        return cls(**typed, rest={k: v for k, v in d.items() if k not in TYPED},
                   order=tuple(d))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) if k in TYPED else self.rest[k] for k in self.order}

    def adding(self, **figures) -> "StepFigures":
        """These figures with ``figures`` added (a figure measured already takes the new
        value and keeps its place)."""
        return StepFigures.from_dict({**self.to_dict(), **figures})

    def restated(self, samples_per_step: float, samples_per_s: float, data_pct: float
                 ) -> "StepFigures":
        """The shares of the step restated for the run without the profiler, which slows the
        host (every operator it records costs microseconds) but hardly the kernels: the step
        time (``samples_per_step / samples_per_s``) and data wait (``data_pct``) from the
        unprofiled steps, the device's busy time from the trace's kernels; the idle rest
        split between host launch and other as in the trace. The profiled figures are kept
        under ``profiled``."""
        keys = ("step_ms", "busy_pct", "data_pct", "idle_data_pct", "idle_host_pct",
                "idle_other_pct")
        profiled = {k: getattr(self, k) for k in keys if k in self.order}
        step_ms = 1e3 * samples_per_step / samples_per_s
        new = {"profiled": profiled, "step_ms": step_ms, "data_pct": data_pct}
        if self.device_ms is not None:
            busy = min(100.0, 100.0 * self.device_ms / step_ms)
            rest = max(0.0, 100.0 - busy - data_pct)
            host, other = profiled["idle_host_pct"], profiled["idle_other_pct"]
            host_share = host / (host + other) if host + other > 0 else 0.0
            new.update(busy_pct=busy, idle_data_pct=data_pct, idle_host_pct=rest * host_share,
                       idle_other_pct=rest * (1 - host_share))
        return self.adding(**new)


TYPED = frozenset(f.name for f in fields(StepFigures)) - {"rest", "order"}
"""The figures ``StepFigures`` holds as fields."""


def profiler_cost(figures: dict, window_rates: list[float] | None,
                  samples_per_step: float | None) -> str | None:
    """The profiled step against the unprofiled one (``figures`` as ``to_dict`` after
    ``restated``): ``558.36 ms per profiled step against 667.30 unprofiled: the profiler's
    cost +0%``, said as not resolved where the profiled step falls inside the range of the
    unprofiled windows' steps (``window_rates``, samples or steps per second, with
    ``samples_per_step``): the machine's noise is larger than the profiler's cost. None
    where either step is unknown."""
    profiled = (figures.get("profiled") or {}).get("step_ms")
    step = figures.get("step_ms")
    if not profiled or not step:
        return None
    text = f"{profiled:.2f} ms per profiled step against {step:.2f} unprofiled"
    if profiled < step:  # a profiler costs time: the machine's pace changed between them
        return text + (": the profiled steps ran faster, so the machine's pace changed "
                       "between them; the profiler's cost is not resolved")
    text += f": the profiler's cost {100 * (profiled / step - 1):+.0f}%"
    rates = [r for r in window_rates or [] if r]
    if rates and samples_per_step:
        fast, slow = (1e3 * samples_per_step / max(rates), 1e3 * samples_per_step / min(rates))
        if profiled <= slow:
            text += (f", not resolved: inside the unprofiled windows' {fast:.2f}-{slow:.2f} ms "
                     f"(the machine's noise is larger)")
    return text
