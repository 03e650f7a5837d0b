"""The bottleneck verdict: one line, with its numbers, and the levers to try -- seed 004's
reading of a timeline ("the GPU waits between kernels", "CPU time > GPU time per step", "IO
overlaps now, but the CPU still can't keep up") made a rule.

``RULES`` is the table: each ``Rule`` has its thresholds as data, a test over the figures of
``kasoku.perf.profile.trace.analyse`` (plus the run's context: its levers, loader, MFU), the
sentence it says and the levers that apply to it (``kasoku.advisor.levers``). The first
rule whose test passes is the verdict; the others that pass are listed as secondary, with any
other cause that takes at least ``SECONDARY_PCT`` of the step (``SHARES``).

A bound is claimed only from figures: compute-bound needs most of the time in matrix products
and a real share of the measured peak (a CPU step at 3% of its peak is not compute-bound:
its products are too small, ``latency-bound``); no rule fires by default. The verdict's lever
is an estimate until ``kasoku.advisor.advice`` has measured the candidates; ``--confirm``
runs the rule's experiments (``Experiment``), which prove the bound, and the advice again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from kasoku.accel.config import AccelConfig
from kasoku.advisor import levers as lv
from kasoku.advisor import limits
from kasoku.advisor.levers import SAYS_NOTHING, Change, Changes, Lever, given, read_change
from kasoku.core.flags import args_text
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.profile.kfac_cost import ms


@dataclass(frozen=True)
class Experiment(Changes):
    """One side of ``--confirm``: the run with ``change`` made (its fields, as a lever's);
    ``faster``: whether the rule predicts at least ``MIN_GAIN`` more throughput (True) or less
    than it (False)."""
    label: str
    change: Mapping[str, object] | Change
    faster: bool

    def to_dict(self) -> dict:
        return {"label": self.label, "args": list(self.args), "faster": self.faster,
                "change": dict(self.change)}

    @classmethod
    def from_dict(cls, d: dict) -> "Experiment":
        """``to_dict`` read back, or a ``profile.json``'s with only ``args``."""
        return cls(d["label"], read_change(d), d["faster"])


@dataclass(frozen=True)
class Rule:
    name: str
    """input-bound, host-bound, latency-bound, compute-bound, memory-bound,
    communication-bound, kfac-bound, ..."""
    thresholds: dict
    test: Callable[[StepFigures, dict], bool]
    """``test(figures, thresholds)``."""
    say: Callable[[StepFigures], str]
    """The reason with its numbers, from the figures."""
    candidates: Callable[[StepFigures, AccelConfig], list[Lever]]
    """The levers to try for it on this run (its figures and its levers), best first
    (``kasoku.advisor.levers``)."""
    fallback: Callable[[StepFigures], Lever]
    """What to say when no candidate applies (or none measured faster)."""
    experiments: Callable[[StepFigures], list[Experiment]] = lambda f: []
    """What ``--confirm`` runs to prove the bound itself (not the advice)."""
    family: str = ""
    """The kind of bound it is a case of ("device-bound" for compute- and memory-bound)."""

    def lever(self, f: StepFigures, accel: AccelConfig) -> Lever:
        """The lever advised before anything is measured: the first candidate (an
        estimate), else the fallback."""
        return next(iter(self.candidates(f, accel)), None) or self.fallback(f)


MIN_GAIN = 1.10
"""A confirming experiment predicted faster must gain at least 10%; one predicted not faster
must gain less than that."""
MATMUL_SHARE = 50.0
"""% of the device's (or the CPU's operators') time in matrix products that makes a step
compute-bound, with a real share of the peak."""
CPU_PEAK_SHARE = 0.2
"""Below this fraction of the measured matmul peak, a CPU step's products are too small to be
its bound (latency-bound); at or above it, with ``MATMUL_SHARE``, compute-bound."""
MEMORY_FULL = 0.85
"""A peak of allocated memory at this fraction of the card's memory leaves no room: the
allocator's cache and fragmentation take much of the rest."""
UNFUSED_ATTENTION_PCT = 5.0
"""% of the device's time in softmax kernels, with no fused attention kernel, that names an
unfused attention."""
SMALL_OP_US = 30.0
"""A CPU step whose operators average less than this (self time) is made of small operators:
their fixed cost and the threads' synchronization dominate."""


@dataclass
class Verdict:
    rule: str
    """The rule's name, its family first where it has one: "device-bound (memory-bound)"."""
    reason: str
    lever: Lever
    experiments: list[Experiment] = field(default_factory=list)
    secondary: list[str] = field(default_factory=list)
    candidates: list[Lever] = field(default_factory=list)
    """The levers that apply, to be measured (the verdict's lever is the best measured)."""
    tried: list[dict] = field(default_factory=list)
    """The candidates as measured (``advice.Outcome.to_dict``), best first."""
    fallback: Lever | None = None
    """The rule's word where no candidate is faster (said after what was tried)."""

    @property
    def line(self) -> str:
        expect = "" if self.lever.expect.strip().lower() in ("", *SAYS_NOTHING) \
            else f" ({self.lever.expect})"
        return f"{self.rule}: {self.reason} -> {self.lever.text}{expect}"

    def to_dict(self) -> dict:
        return {"rule": self.rule, "reason": self.reason, "line": self.line,
                "lever": self.lever.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates],
                "tried": list(self.tried),
                "experiments": [e.to_dict() for e in self.experiments],
                "secondary": list(self.secondary),
                **({"fallback": self.fallback.to_dict()} if self.fallback else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        """A verdict as ``profile.json`` holds it (``to_dict``), read back."""
        return cls(d["rule"], d["reason"], Lever.from_dict(d["lever"]),
                   [Experiment.from_dict(e) for e in d.get("experiments") or []],
                   list(d.get("secondary") or []),
                   [Lever.from_dict(c) for c in d.get("candidates") or []],
                   list(d.get("tried") or []),
                   Lever.from_dict(d["fallback"]) if d.get("fallback") else None)


# --- the figures the rules read ------------------------------------------------------------

def _pct(x) -> str:
    return f"{x:.0f}%"


def _mean_kernel_us(f: StepFigures) -> float:
    n = given(f.kernels_per_step, 0.0)
    return 1e3 * given(f.device_ms, 0.0) / n if n else 0.0


def _mean_op_us(f: StepFigures) -> float:
    n = given(f.ops_per_step, 0.0)
    return 1e3 * given(f.operator_ms, 0.0) / n if n else 0.0


def _cpu_matmul_pct(f: StepFigures) -> float:
    total = given(f.operator_ms, 0.0)
    return 100 * (f.by_kind_ms or {}).get("conv/matmul", 0.0) / total if total else 0.0


def _matmul_pct(f: StepFigures) -> float:
    """A GPU's: % of the kernel time in matrix products."""
    return (f.by_kind_pct or {}).get("conv/matmul", 0.0)


def _peak(f: StepFigures) -> str:
    share = f.peak_fraction
    return (f", {100 * share:.0f}% of its measured {given(f.peak_dtype, 'fp32')} peak"
            if share is not None else "")


def _products(f: StepFigures) -> str:
    """What the step's products are: a model with no convolution (a transformer) has only
    matrix products; unknown (a user's script), both are named."""
    return "matrix products" if f.has_conv is False else "convolutions and matrix products"


def _mfu(f: StepFigures) -> str:
    return f", MFU {100 * f.mfu:.0f}%" if f.mfu else ""


def _gpu(f: StepFigures) -> bool:
    return f.device == "cuda"


def _cpu(f: StepFigures) -> bool:
    return f.device == "cpu"


def _mem_fraction(f: StepFigures) -> float:
    card = f.card_gib
    return (f.mem_peak_gib or 0.0) / card if card else 0.0


def _softmax_pct(f: StepFigures) -> float:
    device_ms = given(f.device_ms, 0.0)
    return 100 * (f.attention_ms or {}).get("softmax", 0.0) / device_ms if device_ms else 0.0


def _host_reason(f: StepFigures) -> str:
    host_slower = given(f.host_ms, 0.0) > given(f.device_ms, 0.0)
    return (f"the GPU is idle {_pct(100 - f.busy_pct)} of the step "
            f"({_pct(f.idle_host_pct)} waiting for launches), "
            f"{f.launches_per_step:.0f} launches/step"
            + (f", host {f.host_ms:.2f} ms > device {f.device_ms:.2f} ms per step"
               if host_slower else ""))


def _cpu_ops(f: StepFigures) -> str:
    return (f"the CPU spends {_pct(given(f.operator_pct, 0.0))} of the profiled step in "
            f"{given(f.ops_per_step, 0):.0f} operators per step (mean {_mean_op_us(f):.0f} us), "
            f"{_pct(_cpu_matmul_pct(f))} of their time in matrix products{_peak(f)}")


# --- K-FAC -----------------------------------------------------------------------------------

def _kfac_experiments(f: StepFigures) -> list[Experiment]:
    """The base optimizer alone: the step K-FAC's work is added to."""
    without = 100.0 / max(1.0, 100.0 - f.kfac["pct"])
    change = {"train.optimizer": f.kfac["base"]}
    return [Experiment(f"the base optimizer alone ({args_text(change)})", change,
                       without >= MIN_GAIN)]


def _kfac_reason(f: StepFigures) -> str:
    k = f.kfac
    split = ", ".join(f"{p.removeprefix('kfac_')} {_pct(k['phases_pct'][p])}"
                      for p in k["phases_pct"] if k["phases_pct"][p] > 0)
    return (f"K-FAC's curvature work is {_pct(k['pct'])} of the step ({split}): "
            f"{ms(k['ms_per_step'])} of {ms(k['step_ms'])} ms, the step without it "
            f"{ms(k['without_ms'])} ms (factors every {k['factor_update_freq']} steps, "
            f"inverses every {k['inv_update_freq']})")


# --- the proofs of a bound (--confirm) ----------------------------------------------------

def _on_device(f: StepFigures) -> list[Experiment]:
    """Synthetic data on the device, predicted not faster: the bound is not the input. Left
    out where the step's wait for data alone would make it ``MIN_GAIN`` faster (a host-bound
    step that also waits 27% for its batches: the prediction would be wrong by the wait,
    not by the bound)."""
    if lv.idle_speedup(given(f.data_pct, 0.0)) >= MIN_GAIN:
        return []
    change = lv.synthetic(f) if _gpu(f) else {"data.synthetic": True}
    return [Experiment("synthetic data" + (" on the device" if _gpu(f) else ""), change, False)]


def _batch(f: StepFigures, faster: bool) -> Experiment:
    change = lv.batch_x2(f)
    return Experiment(f"batch x2 ({change['train.batch_size']})", change, faster)


RULES: list[Rule] = [
    # First: a card that is full limits the batch and the model before any speed does.
    Rule("memory-full", {"mem_fraction": MEMORY_FULL},
         lambda f, t: _gpu(f) and _mem_fraction(f) >= t["mem_fraction"],
         lambda f: (f"the step's peak memory is {f.mem_peak_gib:.1f} GiB of the card's "
                    f"{f.card_gib:.1f} GiB ({_pct(100 * _mem_fraction(f))}): no room for a "
                    f"larger batch or model"),
         lv.memory_full_candidates, lv.memory_full_fallback),
    Rule("input-bound", {"data_pct": 15.0},
         # ... and the largest cause of idle time: a host too slow to launch also waits
         # in the loader, but feeding it faster would not help much.
         lambda f, t: given(f.data_pct, 0.0) >= t["data_pct"]
         and given(f.data_pct, 0.0) >= given(f.idle_host_pct, 0.0),
         lambda f: (f"the {'GPU' if _gpu(f) else 'CPU'} waits for data "
                    f"{_pct(f.data_pct)} of the step"),
         lv.input_candidates, lv.input_fallback,
         lambda f: [Experiment("synthetic data on the device", lv.synthetic(f), True)]),
    Rule("communication-bound", {"comm_pct": 20.0},
         lambda f, t: given(f.comm_pct, 0.0) >= t["comm_pct"],
         lambda f: f"collectives (all-reduce) take {_pct(f.comm_pct)} of the step",
         lv.communication_candidates,
         lambda f: lv.nothing_left("overlap the all-reduce with the backward pass"),
         # The same all-reduce per step over twice the samples: more samples per second.
         lambda f: [Experiment("batch x2 per worker", lv.batch_x2(f), True)]),
    Rule("kfac-bound", {"kfac_pct": 25.0},
         # Before the device's rules: K-FAC's work keeps the device (or the CPU) busy, and
         # its own intervals are the lever, whatever bound the rest of the step is.
         lambda f, t: given(f.kfac_pct, 0.0) >= t["kfac_pct"] and bool(f.kfac),
         _kfac_reason, lv.kfac_candidates, lv.kfac_lever, _kfac_experiments),
    Rule("host-bound", {"idle_host_pct": 25.0, "busy_pct": 75.0},
         lambda f, t: _gpu(f) and (
             given(f.idle_host_pct, 0.0) >= t["idle_host_pct"]
             or (given(f.busy_pct, 100.0) < t["busy_pct"]
                 and given(f.host_ms, 0.0) > given(f.device_ms, 0.0))),
         _host_reason, lv.host_candidates,
         lambda f: lv.nothing_left("the launches are as few as they get"),
         lambda f: [*_on_device(f), _batch(f, True)]),
    Rule("latency-bound", {"busy_pct": 75.0, "mean_kernel_us": 10.0},
         # busy, but with kernels so short that each is mostly its own start-up and tail:
         # the device is not full, whatever the busy share says.
         lambda f, t: _gpu(f) and given(f.busy_pct, 0.0) >= t["busy_pct"]
         and 0 < _mean_kernel_us(f) < t["mean_kernel_us"],
         lambda f: (f"the GPU is busy {_pct(f.busy_pct)} of the step, but its "
                    f"{f.kernels_per_step:.0f} kernels per step average "
                    f"{_mean_kernel_us(f):.1f} us, too short to fill it{_mfu(f)}"
                    f"{limits.roofline_reason(f)}"),
         limits.first_the_roofline(lv.latency_candidates),
         lambda f: limits.roofline_fallback(
             f, lv.nothing_left("the kernels are as few as they get")),
         lambda f: [*_on_device(f), _batch(f, True)], "device-bound"),
    Rule("compute-bound", {"busy_pct": 75.0, "matmul_pct": MATMUL_SHARE},
         lambda f, t: _gpu(f) and given(f.busy_pct, 0.0) >= t["busy_pct"]
         and _matmul_pct(f) >= t["matmul_pct"],
         lambda f: (f"the GPU is busy {_pct(f.busy_pct)} of the step, "
                    f"{_pct(f.by_kind_pct['conv/matmul'])} of it in "
                    f"{_products(f)}{_mfu(f)}{limits.roofline_reason(f)}"),
         limits.first_the_roofline(lv.gpu_compute_candidates),
         lambda f: limits.roofline_fallback(f, lv.nothing_left("the step is in the math")),
         lambda f: [*_on_device(f), _batch(f, False)], "device-bound"),
    Rule("memory-bound", {"busy_pct": 75.0, "matmul_pct": MATMUL_SHARE},
         lambda f, t: _gpu(f) and given(f.busy_pct, 0.0) >= t["busy_pct"]
         and _matmul_pct(f) < t["matmul_pct"],
         lambda f: (f"the GPU is busy {_pct(f.busy_pct)} of the step, only "
                    f"{_pct(f.by_kind_pct['conv/matmul'])} of it in matrix products: "
                    f"the rest moves memory{_mfu(f)}{limits.roofline_reason(f)}"),
         limits.first_the_roofline(lv.gpu_memory_candidates),
         lambda f: limits.roofline_fallback(f, lv.gpu_memory_fallback(f)),
         lambda f: [*_on_device(f), _batch(f, False)], "device-bound"),
    Rule("dispatch-bound", {"operator_pct": 60.0},
         lambda f, t: _cpu(f) and given(f.operator_pct, 100.0) < t["operator_pct"],
         lambda f: (f"only {_pct(f.operator_pct)} of the step is inside operators "
                    f"({f.ops_per_step:.0f} per step); the rest is Python and dispatch"),
         lv.cpu_dispatch_candidates,
         lambda f: lv.nothing_left("the operators are as few as they get"),
         lambda f: [_batch(f, True)]),
    Rule("compute-bound", {"matmul_pct": MATMUL_SHARE, "peak_fraction": CPU_PEAK_SHARE,
                           "mean_op_us": SMALL_OP_US},
         lambda f, t: _cpu(f) and _cpu_matmul_pct(f) >= t["matmul_pct"]
         and (f.peak_fraction or 0.0) >= t["peak_fraction"]
         and _mean_op_us(f) >= t["mean_op_us"],
         _cpu_ops, lv.cpu_compute_candidates,
         lambda f: lv.nothing_left("the step is in the math; a GPU, or more cores"),
         lambda f: [*_on_device(f), _batch(f, False)]),
    Rule("latency-bound", {"mean_op_us": SMALL_OP_US, "matmul_pct": MATMUL_SHARE,
                           "peak_fraction": CPU_PEAK_SHARE},
         # Small operators, or products too small to reach the cores' peak.
         lambda f, t: _cpu(f) and (
             0 < _mean_op_us(f) < t["mean_op_us"]
             or (_cpu_matmul_pct(f) >= t["matmul_pct"]
                 and f.peak_fraction is not None
                 and f.peak_fraction < t["peak_fraction"])),
         lambda f: _cpu_ops(f) + ": too small to keep the cores busy",
         lv.cpu_latency_candidates,
         lambda f: lv.nothing_left("the operators are as large as this batch makes them"),
         lambda f: [*_on_device(f), _batch(f, True)]),
    Rule("memory-bound", {"matmul_pct": MATMUL_SHARE, "mean_op_us": SMALL_OP_US},
         lambda f, t: _cpu(f) and _mean_op_us(f) >= t["mean_op_us"]
         and _cpu_matmul_pct(f) < t["matmul_pct"],
         lambda f: _cpu_ops(f) + ": the rest moves memory (element-wise, copies, norms)",
         lv.cpu_memory_candidates,
         lambda f: lv.nothing_left("the time is in memory-bound operators"),
         _on_device),
    # Last: as a secondary cause it names what the device-bound rules above cannot see.
    Rule("attention-unfused", {"softmax_pct": UNFUSED_ATTENTION_PCT},
         lambda f, t: _gpu(f) and bool(f.has_blocks)
         and (f.attention_ms or {}).get("fused", 0.0) == 0.0
         and _softmax_pct(f) >= t["softmax_pct"],
         lambda f: (f"attention runs unfused: softmax kernels take "
                    f"{_pct(_softmax_pct(f))} of the device's time and no flash or "
                    f"memory-efficient attention kernel ran"),
         lv.attention_candidates, lv.attention_fallback),
]


SECONDARY_PCT = 10.0
"""A cause below the verdict's thresholds is still named (as secondary) from this share of the
step on."""

SHARES = (("input-bound", lambda f: f.data_pct, "waiting for data"),
          ("host-bound", lambda f: f.idle_host_pct, "the device waiting for launches"),
          ("communication-bound", lambda f: f.comm_pct, "in collectives"),
          ("kfac-bound", lambda f: f.kfac_pct, "in K-FAC's curvature work (factors, inverses, "
           "preconditioning)"))
"""The shares of the step that name a cause: (the rule it belongs to, figure, words)."""


def judge(figures: StepFigures, accel: AccelConfig, rules: list[Rule] = RULES) -> Verdict:
    """The verdict for a profiled step's ``figures`` (``Window.analyse``'s, with what the
    command knows of the run: ``loader`` and ``data_kind``, ``batch_size``, ``mfu`` or
    ``peak_fraction``, ``has_conv``, ``has_blocks``, ``kfac`` and ``kfac_pct`` from
    ``kfac_cost.kfac_figures``...) and the run's levers (``accel``). Called once per profile;
    its lever is an estimate (the first candidate) until ``advice.advise`` replaces it by the
    best measured."""
    passed = [r for r in rules if r.test(figures, r.thresholds)]
    if not passed:
        busy = (f"the GPU is busy {given(figures.busy_pct, 0):.0f}% of the step"
                if _gpu(figures) else _cpu_ops(figures))
        return Verdict("balanced", f"no single bottleneck: {busy}",
                       lv.balanced_lever(figures))
    first = passed[0]
    name = f"{first.family} ({first.name})" if first.family else first.name
    secondary = [f"{r.name}: {r.say(figures)}" for r in passed[1:] if r.name != first.name]
    named = {first.name} | {r.name for r in passed}
    for rule, figure, words in SHARES:
        share = given(figure(figures), 0.0)
        if rule not in named and share >= SECONDARY_PCT:
            secondary.append(f"{_pct(share)} of the step {words}")
    return Verdict(name, first.say(figures), first.lever(figures, accel),
                   first.experiments(figures), secondary, first.candidates(figures, accel),
                   fallback=first.fallback(figures))
