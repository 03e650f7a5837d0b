"""The bottleneck verdict: one line, with its numbers, and the next lever with its expected
effect -- seed 004's reading of a timeline ("the GPU waits between kernels", "CPU time > GPU
time per step", "IO overlaps now, but the CPU still can't keep up") made a rule.

``RULES`` is the table: each ``Rule`` has its thresholds as data, a test over the figures of
``kasoku.perf.profile.trace.analyse`` (plus the run's context: its levers, loader, MFU), the
sentence it says and the lever it suggests. The first rule whose test passes is the verdict;
the others that pass are listed as secondary, with any other cause that takes at least
``SECONDARY_PCT`` of the step (``SHARES``). ``--confirm`` runs the rule's experiments
(``Experiment``): each a change of the command line and what throughput should do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kasoku.perf.profile.kfac_cost import ms


@dataclass(frozen=True)
class Lever:
    text: str
    """What to do, as the flags to add (``--cuda-graph``) or a sentence."""
    expect: str
    """The expected effect (``~2x``, ``none: ...``)."""
    args: tuple[str, ...] = ()
    """Command-line arguments that apply it (for ``--confirm``); () when none can."""
    speedup: float | None = None
    """The expected throughput ratio, where one can be estimated."""


@dataclass(frozen=True)
class Experiment:
    """One side of ``--confirm``: the run with ``args`` changed; ``faster``: whether the rule
    predicts at least ``MIN_GAIN`` more throughput (True) or less than it (False)."""
    label: str
    args: tuple[str, ...]
    faster: bool


@dataclass(frozen=True)
class Rule:
    name: str
    """input-bound, host-bound, latency-bound, compute-bound, memory-bound,
    communication-bound, kfac-bound, ..."""
    thresholds: dict
    test: Callable[[dict, dict], bool]
    """``test(figures, thresholds)``."""
    say: Callable[[dict], str]
    """The reason with its numbers, from the figures."""
    lever: Callable[[dict], Lever]
    experiments: Callable[[dict], list[Experiment]] = lambda f: []
    family: str = ""
    """The kind of bound it is a case of ("device-bound" for compute- and memory-bound)."""


MIN_GAIN = 1.10
"""A confirming experiment predicted faster must gain at least 10%; one predicted not faster
must gain less than that."""


@dataclass
class Verdict:
    rule: str
    """The rule's name, its family first where it has one: "device-bound (memory-bound)"."""
    reason: str
    lever: Lever
    experiments: list[Experiment] = field(default_factory=list)
    secondary: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        return f"{self.rule}: {self.reason} -> {self.lever.text} (expect {self.lever.expect})"

    def to_dict(self) -> dict:
        return {"rule": self.rule, "reason": self.reason, "line": self.line,
                "lever": {"text": self.lever.text, "expect": self.lever.expect,
                          "args": list(self.lever.args), "speedup": self.lever.speedup},
                "experiments": [{"label": e.label, "args": list(e.args), "faster": e.faster}
                                for e in self.experiments],
                "secondary": list(self.secondary)}


# --- context helpers: what the run already has ---------------------------------------------

def _cfg(f: dict) -> dict:
    return f.get("config") or {}


def _synthetic(f: dict) -> tuple[str, ...]:
    """Arguments that feed the step synthetic batches from the device (no loading, no copy):
    a set small enough to be held whole, of whole batches (at least two and 512 samples: an
    epoch's last, partial batch would run outside a CUDA graph, measured 2x slower on a
    0.26 ms MNIST step)."""
    batch = int(f.get("batch_size") or 1)
    size = batch * max(2, -(-512 // batch))
    return ("--synthetic", "--synthetic-size", str(size), "--loader", "device")


def _batch_x2(f: dict) -> tuple[str, ...]:
    return ("--batch-size", str(2 * int(f.get("batch_size") or 1)))


def _speedup_from_idle(idle_pct: float, cap: float = 4.0) -> float:
    return min(cap, 100.0 / max(1.0, 100.0 - idle_pct))


# --- the rules ------------------------------------------------------------------------------

def _input_lever(f: dict) -> Lever:
    gain = _speedup_from_idle(f["data_pct"])
    loader = (f.get("loader") or "serial").split(":")[0]
    if loader in ("serial", "threads"):
        return Lever("load in worker processes: --loader multiprocess (JPEG folders on a GPU: "
                     "--loader gpu-jpeg)", f"up to ~{gain:.1f}x", ("--loader", "multiprocess"),
                     gain)
    return Lever("more loader workers (--loader KIND:N), smaller images, or faster storage",
                 f"up to ~{gain:.1f}x", (), gain)


def _host_lever(f: dict) -> Lever:
    gain = _speedup_from_idle(f.get("idle_host_pct", 0.0) + f.get("idle_other_pct", 0.0))
    cfg = _cfg(f)
    if f.get("device") == "cuda" and not cfg.get("cuda_graph"):
        return Lever("capture the step as a CUDA graph: --cuda-graph", f"~{gain:.1f}x",
                     ("--cuda-graph",), gain)
    return Lever(f"a larger batch per launch: {' '.join(_batch_x2(f))}",
                 "more samples per second at the same launches", _batch_x2(f), None)


def _compute_lever(f: dict) -> Lever:
    cfg = _cfg(f)
    precision = cfg.get("precision", "fp32")
    if f.get("device") == "cuda" and precision in ("fp32", "tf32"):
        return Lever("tensor cores in bf16: --precision bf16", "~2x", ("--precision", "bf16"),
                     2.0)
    if f.get("has_conv") and not cfg.get("channels_last"):
        return Lever("NHWC for tensor-core convolutions: --channels-last", "~1.3x",
                     ("--channels-last",), 1.3)
    mfu = f.get("mfu")
    at = f" at {100 * mfu:.0f}% MFU" if mfu else ""
    return Lever(f"no cheap lever left{at}: the step is in the math", "none", (), None)


def _memory_lever(f: dict) -> Lever:
    cfg = _cfg(f)
    if not cfg.get("compile"):
        return Lever("fuse the element-wise kernels: --compile", "~1.3x", ("--compile",), 1.3)
    if f.get("has_conv") and cfg.get("channels_last") and not cfg.get("fused_bn"):
        return Lever("batch norm + ReLU as kasoku's fused kernels: --fused-bn", "~1.1x",
                     ("--fused-bn",), 1.1)
    kinds = {k: v for k, v in f.get("by_kind_ms", {}).items() if k != "conv/matmul"}
    top = max(kinds, key=kinds.get) if kinds else "other"
    return Lever(f"no cheap lever left: the time is in memory-bound kernels ({top}: "
                 f"{kinds.get(top, 0.0):.1f} ms/step)", "none", (), None)


def _host_reason(f: dict) -> str:
    host_slower = f.get("host_ms", 0.0) > f.get("device_ms", 0.0)
    return (f"the GPU is idle {_pct(100 - f['busy_pct'])} of the step "
            f"({_pct(f['idle_host_pct'])} waiting for launches), "
            f"{f['launches_per_step']:.0f} launches/step"
            + (f", host {f['host_ms']:.2f} ms > device {f['device_ms']:.2f} ms per step"
               if host_slower else ""))


def _proof(lever: Callable[[dict], Lever]):
    """The experiments of a step bound by the host or the device: synthetic data does not
    help it; the lever does, or, with none left, neither does a larger batch (the device is
    full)."""
    def experiments(f: dict) -> list[Experiment]:
        chosen = lever(f)
        last = Experiment(chosen.text.split(": ")[-1], chosen.args, True) if chosen.args \
            else Experiment(f"batch x2 ({_batch_x2(f)[1]})", _batch_x2(f), False)
        return [Experiment("synthetic data on the device", _synthetic(f), False), last]
    return experiments


def _cpu_compute_lever(f: dict) -> Lever:
    """bf16 only where the CPU has bf16 hardware (``cpu_bf16``, from ``kasoku.perf.cpuinfo``):
    without it autocast converts to bf16 and computes in fp32, slower than fp32."""
    cfg = _cfg(f)
    isa = f.get("cpu_bf16_isa") or "bf16"
    if f.get("cpu_bf16") and cfg.get("precision", "fp32") == "fp32":
        # ~1.5x: the MNIST MLP measured 1.6x on AVX512-BF16 (2-core EPYC, with keep_memory).
        what = ("AVX512-BF16 instructions of this CPU (up to 2x the fp32 rate of its matrix "
                "products)" if isa == "AVX512-BF16" else f"{isa} matrix units of this CPU")
        return Lever(f"{what}: --precision bf16", "~1.5x", ("--precision", "bf16"), 1.5)
    why = (f"its {isa} units in use already" if f.get("cpu_bf16") else
           "no bf16 hardware (AMX-BF16, AVX512-BF16): bf16 would be computed in fp32, slower")
    return Lever(f"no cheap lever left on this CPU ({why}); a GPU, or more cores (--threads)",
                 "none", (), None)


def _dispatch_lever(f: dict) -> Lever:
    fuse = "" if _cfg(f).get("compile") else " (or --compile to fuse operators)"
    return Lever(f"more work per operator: {' '.join(_batch_x2(f))}{fuse}",
                 "more samples per second at the same overhead per step", _batch_x2(f), None)


def _kfac_lever(f: dict) -> Lever:
    """Half as many of K-FAC's costliest steps: the inverse steps or the factor steps (each
    step's share of that phase halves), else, for the preconditioning (every step), the
    inverse method's two products per layer. Fewer curvature updates may slow the loss's
    fall: compare the runs' accuracy over time, not only their speed."""
    k = f["kfac"]
    top = max(k["phases_pct"], key=k["phases_pct"].get)
    gain = 100.0 / max(1.0, 100.0 - k["phases_pct"][top] / 2)
    method = " (or --kfac-method inverse: Cholesky inverses)" if k["method"] == "eigen" else ""
    if top in ("kfac_inverse", "kfac_factors"):
        what, key = (("inverses", "inv_update_freq") if top == "kfac_inverse"
                     else ("factors", "factor_update_freq"))
        flag = f"--kfac-{key.replace('_', '-')}"
        args = (flag, str(2 * k[key]))
        return Lever(f"update K-FAC's {what} half as often: {' '.join(args)}"
                     + (method if top == "kfac_inverse" else ""),
                     f"~{gain:.2f}x, with fewer curvature updates", args, gain)
    if k["method"] == "eigen":
        return Lever("precondition with the factors' inverses: --kfac-method inverse",
                     "faster preconditioning, with damping that grows with the factors",
                     ("--kfac-method", "inverse"), None)
    return Lever("no cheap lever left in K-FAC: its preconditioning runs every step",
                 "none", (), None)


def _kfac_experiments(f: dict) -> list[Experiment]:
    """The lever, and the base optimizer alone: the step K-FAC's work is added to."""
    k, lever = f["kfac"], _kfac_lever(f)
    out = [Experiment(" ".join(lever.args), lever.args, lever.speedup >= MIN_GAIN)] \
        if lever.args and lever.speedup is not None else []
    without = 100.0 / max(1.0, 100.0 - k["pct"])
    return out + [Experiment(f"the base optimizer alone (--optimizer {k['base']})",
                             ("--optimizer", k["base"]), without >= MIN_GAIN)]


def _kfac_reason(f: dict) -> str:
    k = f["kfac"]
    split = ", ".join(f"{p.removeprefix('kfac_')} {_pct(k['phases_pct'][p])}"
                      for p in k["phases_pct"] if k["phases_pct"][p] > 0)
    return (f"K-FAC's curvature work is {_pct(k['pct'])} of the step ({split}): "
            f"{ms(k['ms_per_step'])} of {ms(k['step_ms'])} ms, the step without it "
            f"{ms(k['without_ms'])} ms (factors every {k['factor_update_freq']} steps, "
            f"inverses every {k['inv_update_freq']})")


def _mean_kernel_us(f: dict) -> float:
    n = f.get("kernels_per_step", 0.0)
    return 1e3 * f.get("device_ms", 0.0) / n if n else 0.0


def _pct(x) -> str:
    return f"{x:.0f}%"


RULES: list[Rule] = [
    Rule("input-bound", {"data_pct": 15.0},
         # ... and the largest cause of idle time: a host too slow to launch also waits
         # in the loader, but feeding it faster would not help much.
         lambda f, t: f.get("data_pct", 0.0) >= t["data_pct"]
         and f.get("data_pct", 0.0) >= f.get("idle_host_pct", 0.0),
         lambda f: (f"the {'GPU' if f['device'] == 'cuda' else 'CPU'} waits for data "
                    f"{_pct(f['data_pct'])} of the step"),
         _input_lever,
         lambda f: [Experiment("synthetic data on the device", _synthetic(f), True)]),
    Rule("communication-bound", {"comm_pct": 20.0},
         lambda f, t: f.get("comm_pct", 0.0) >= t["comm_pct"],
         lambda f: f"collectives (all-reduce) take {_pct(f['comm_pct'])} of the step",
         lambda f: Lever("a larger batch per device (fewer exchanges per sample), or overlap "
                         "the all-reduce with the backward pass", "up to "
                         f"~{_speedup_from_idle(f['comm_pct']):.1f}x"),
         # The same all-reduce per step over twice the samples: more samples per second.
         lambda f: [Experiment("batch x2 per worker", _batch_x2(f), True)]),
    Rule("kfac-bound", {"kfac_pct": 25.0},
         # Before the device's rules: K-FAC's work keeps the device (or the CPU) busy, and
         # its own intervals are the lever, whatever bound the rest of the step is.
         lambda f, t: f.get("kfac_pct", 0.0) >= t["kfac_pct"] and bool(f.get("kfac")),
         _kfac_reason, _kfac_lever, _kfac_experiments),
    Rule("host-bound", {"idle_host_pct": 25.0, "busy_pct": 75.0},
         lambda f, t: f.get("device") == "cuda" and (
             f.get("idle_host_pct", 0.0) >= t["idle_host_pct"]
             or (f.get("busy_pct", 100.0) < t["busy_pct"]
                 and f.get("host_ms", 0.0) > f.get("device_ms", 0.0))),
         _host_reason, _host_lever, _proof(_host_lever)),
    Rule("latency-bound", {"busy_pct": 75.0, "mean_kernel_us": 10.0},
         # busy, but with kernels so short that each is mostly its own start-up and tail:
         # the device is not full, whatever the busy share says.
         lambda f, t: f.get("device") == "cuda" and f.get("busy_pct", 0.0) >= t["busy_pct"]
         and 0 < _mean_kernel_us(f) < t["mean_kernel_us"],
         lambda f: (f"the GPU is busy {_pct(f['busy_pct'])} of the step, but its "
                    f"{f['kernels_per_step']:.0f} kernels per step average "
                    f"{_mean_kernel_us(f):.1f} us, too short to fill it"
                    + (f", MFU {100 * f['mfu']:.0f}%" if f.get("mfu") else "")),
         lambda f: Lever(f"more work per kernel: {' '.join(_batch_x2(f))}",
                         "up to ~2x samples/s", _batch_x2(f), None),
         lambda f: [Experiment("synthetic data on the device", _synthetic(f), False),
                    Experiment(f"batch x2 ({_batch_x2(f)[1]})", _batch_x2(f), True)],
         "device-bound"),
    Rule("compute-bound", {"busy_pct": 75.0, "matmul_pct": 50.0},
         lambda f, t: f.get("device") == "cuda" and f.get("busy_pct", 0.0) >= t["busy_pct"]
         and f.get("by_kind_pct", {}).get("conv/matmul", 0.0) >= t["matmul_pct"],
         lambda f: (f"the GPU is busy {_pct(f['busy_pct'])} of the step, "
                    f"{_pct(f['by_kind_pct']['conv/matmul'])} of it in convolutions and "
                    f"matrix products" + (f", MFU {100 * f['mfu']:.0f}%" if f.get("mfu")
                                          else "")),
         _compute_lever, _proof(_compute_lever), "device-bound"),
    Rule("memory-bound", {"busy_pct": 75.0, "matmul_pct": 50.0},
         lambda f, t: f.get("device") == "cuda" and f.get("busy_pct", 0.0) >= t["busy_pct"]
         and f.get("by_kind_pct", {}).get("conv/matmul", 0.0) < t["matmul_pct"],
         lambda f: (f"the GPU is busy {_pct(f['busy_pct'])} of the step, only "
                    f"{_pct(f['by_kind_pct']['conv/matmul'])} of it in matrix products: "
                    f"the rest moves memory" + (f", MFU {100 * f['mfu']:.0f}%"
                                                if f.get("mfu") else "")),
         _memory_lever, _proof(_memory_lever), "device-bound"),
    Rule("dispatch-bound", {"operator_pct": 60.0},
         lambda f, t: f.get("device") == "cpu" and f.get("operator_pct", 100.0)
         < t["operator_pct"],
         lambda f: (f"only {_pct(f['operator_pct'])} of the step is inside operators "
                    f"({f['ops_per_step']:.0f} per step); the rest is Python and dispatch"),
         _dispatch_lever,
         lambda f: [Experiment(f"batch x2 ({_batch_x2(f)[1]})", _batch_x2(f), True)]),
    Rule("compute-bound", {},
         lambda f, t: f.get("device") == "cpu",
         lambda f: (f"the CPU spends {_pct(f.get('operator_pct', 0.0))} of the step in "
                    f"operators, {f['by_kind_ms'].get('conv/matmul', 0.0):.2f} ms of "
                    f"{f['step_ms']:.2f} ms in matrix products"
                    + (f", {100 * f['peak_fraction']:.0f}% of its measured "
                       f"{f.get('peak_dtype', 'fp32')} peak"
                       if f.get("peak_fraction") else "")),
         _cpu_compute_lever,
         lambda f: [Experiment("synthetic data", ("--synthetic",), False)]),
]


SECONDARY_PCT = 10.0
"""A cause below the verdict's thresholds is still named (as secondary) from this share of the
step on."""

SHARES = (("input-bound", "data_pct", "waiting for data"),
          ("host-bound", "idle_host_pct", "the device waiting for launches"),
          ("communication-bound", "comm_pct", "in collectives"),
          ("kfac-bound", "kfac_pct", "in K-FAC's curvature work (factors, inverses, "
           "preconditioning)"))
"""The shares of the step that name a cause: (the rule it belongs to, figure, words)."""


def judge(figures: dict, rules: list[Rule] = RULES) -> Verdict:
    """The verdict for ``figures`` (``analyse``'s dict plus context keys: ``config``, the
    levers as ``AccelConfig`` fields; ``loader``; ``batch_size``; ``mfu``; ``has_conv``;
    ``cpu_bf16`` and ``cpu_bf16_isa``; ``peak_fraction``; ``kfac`` and ``kfac_pct``, from
    ``kfac_cost.kfac_figures``)."""
    passed = [r for r in rules if r.test(figures, r.thresholds)]
    if not passed:
        return Verdict("balanced", f"no single bottleneck: the GPU is busy "
                       f"{figures.get('busy_pct', 0):.0f}% of the step",
                       Lever("see the phases and top kernels", "unknown"))
    first = passed[0]
    name = f"{first.family} ({first.name})" if first.family else first.name
    secondary = [f"{r.name}: {r.say(figures)}" for r in passed[1:] if r.name != first.name]
    named = {first.name} | {r.name for r in passed}
    for rule, key, words in SHARES:
        share = figures.get(key, 0.0)
        if rule not in named and share >= SECONDARY_PCT:
            secondary.append(f"{_pct(share)} of the step {words}")
    return Verdict(name, first.say(figures), first.lever(figures),
                   first.experiments(figures), secondary)
