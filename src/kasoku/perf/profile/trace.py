"""Analysis of a profiled window of training steps, from its Chrome trace (what
``torch.profiler``'s ``export_chrome_trace`` writes; it opens in Perfetto and chrome://tracing).

The window's steps are cut by kasoku's phase spans (``kasoku/data``, ``kasoku/forward``, ...,
host annotations written by ``kasoku.perf.profile.window``): a step runs from one
``kasoku/data`` span's start to the next. The first step is the anchor only: on a GPU the host
may run ahead of the device, so the analysed window starts where the device finished the
anchor step's work (or where the host began step 2, if later) and ends where the device
finished the last step's work.

What is computed (``analyse``), per step:

- device busy time (the union of kernels, copies and fills) and the idle rest, split three
  ways: *waiting for data* (idle while the host is inside the loader: a ``kasoku/data``
  span), *waiting for the host to launch* (the kernel after the gap was launched after the
  device ran dry: HTA's host-wait rule) and *other* (the kernel was queued already: a
  dependency, a synchronization, a copy from pageable memory). Kernels replayed from a CUDA
  graph all carry the graph launch's correlation id: a gap between two kernels of the same
  replay is never a launch wait (the host launched them all at once), and the first kernel of
  a replay counts as launched when ``cudaGraphLaunch`` was called;
- kernels and launches; the host's busy time (the step minus the time it sat in the loader or
  blocked in a synchronizing call) against the device's (seed 004: is CPU time < GPU time?);
- time by kernel kind (``kasoku.perf.profile.kernels.classify``), collective (NCCL) time, top
  kernels and top operators (host self time); on a GPU the time in fused attention kernels
  and in softmax kernels (``attention_ms``: an attention that runs unfused shows softmax time
  and no fused kernel, ``kernels.attention_kind``);
- each phase's time on the host, and on a GPU the device time of the kernels it launched
  (kernels replayed from a graph are split by name: forward, backward, update -- approximate);
- on a CPU (no device rows) the phases and the operators' self time by kind (the step's
  operators only: those that began inside a ``kasoku/data`` span on its thread are the
  loader's, a DataLoader without workers, counted in the wait for data), and the time
  gloo's threads spend in collectives (``gloo:*`` spans, merged; they run beside the step's
  own thread, so this is their share of the step, not all of it waited for).

HTA (Holistic Trace Analysis) computes a similar idle-time split but misreads graph replays,
gives no verdict and pulls in a notebook stack; this is the few hundred lines kasoku needs.
"""
from __future__ import annotations

import bisect
import collections
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from kasoku.perf.profile.kernels import (
    CATEGORIES,
    KERNEL_CLASSES,
    attention_kind,
    classify,
    kernel_class,
)

PHASE_PREFIX = "kasoku/"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
                "cudaLaunchCooperativeKernel")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize")
_BACKWARD = ("backward", "bwd", "dgrad", "wgrad", "grad_input", "grad_weight")


@dataclass
class Span:
    name: str
    start: float
    """Microseconds, the trace's clock."""
    end: float
    cat: str = ""
    tid: object = None
    correlation: int | None = None

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    phases: list[Span] = field(default_factory=list)
    """Host spans named ``kasoku/PHASE``, in time order."""
    device: list[Span] = field(default_factory=list)
    """Kernels, copies and fills, in time order."""
    runtime: dict[int, Span] = field(default_factory=dict)
    """CUDA runtime/driver calls that launch work, by correlation id."""
    called: dict[int, float] = field(default_factory=dict)
    """When each CUDA runtime/driver call with a correlation id began (a launch, or a
    synchronous copy): what places device work in the step that asked for it."""
    syncs: list[Span] = field(default_factory=list)
    ops: list[Span] = field(default_factory=list)
    """Host operators (``cpu_op``)."""
    collectives: list[Span] = field(default_factory=list)
    """gloo's collectives on its own threads (``gloo:all_reduce``, ...)."""


def load(path) -> Trace:
    """Parse a Chrome trace file (``.json`` or ``.json.gz``) written by torch.profiler."""
    return parse(read_events(path))


def read_events(path) -> list[dict]:
    """A Chrome trace file's events, as written (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def parse(events: list[dict]) -> Trace:
    """A ``Trace`` from the ``traceEvents`` list."""
    t = Trace()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name, cat = e.get("name", ""), e.get("cat", "")
        start = float(e["ts"])
        span = Span(name, start, start + float(e["dur"]), cat, e.get("tid"),
                    (e.get("args") or {}).get("correlation"))
        if cat == "user_annotation" and name.startswith(PHASE_PREFIX):
            t.phases.append(span)
        elif cat == "user_annotation" and name.startswith("gloo:"):
            t.collectives.append(span)
        elif cat in DEVICE_CATS:
            t.device.append(span)
        elif cat in ("cuda_runtime", "cuda_driver"):
            if span.correlation is not None:
                t.called[span.correlation] = start
            if name in LAUNCH_NAMES and span.correlation is not None:
                t.runtime[span.correlation] = span
            elif name in SYNC_NAMES:
                t.syncs.append(span)
        elif cat == "cpu_op":
            t.ops.append(span)
    for spans in (t.phases, t.device, t.syncs, t.ops):
        spans.sort(key=lambda s: (s.start, -s.end))
    return t


def phase_name(span: Span) -> str:
    return span.name[len(PHASE_PREFIX):]


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    """Length of ``[a, b]`` covered by ``merged`` (sorted, disjoint)."""
    total = 0.0
    i = max(0, bisect.bisect_right(merged, (a, float("inf"))) - 1)
    for s, e in merged[i:]:
        if s >= b:
            break
        total += max(0.0, min(b, e) - max(a, s))
    return total


def self_times(ops: list[Span]) -> dict[str, float]:
    """Each operator name's self time (its duration less its direct children's), summed."""
    out: dict[str, float] = collections.defaultdict(float)
    by_tid: dict = collections.defaultdict(list)
    for op in ops:
        by_tid[op.tid].append(op)
    for spans in by_tid.values():
        stack: list[list] = []  # [span, children's time]
        for op in spans:  # sorted by start, longest first
            while stack and stack[-1][0].end <= op.start:
                done = stack.pop()
                out[done[0].name] += done[0].dur - done[1]
            if stack:
                stack[-1][1] += op.dur
            stack.append([op, 0.0])
        for span, children in stack:
            out[span.name] += span.dur - children
    return out


@dataclass
class Steps:
    """The steps of a trace: each step's start on the host (its ``kasoku/data`` span)."""
    starts: list[float]
    end: float
    """Where the last step ended on the host (the end of its last phase span)."""

    @property
    def count(self) -> int:
        return len(self.starts)

    def index(self, t: float) -> int:
        """The step running at host time ``t`` (-1 before the first)."""
        return bisect.bisect_right(self.starts, t) - 1


def steps_of(trace: Trace) -> Steps:
    starts = [s.start for s in trace.phases if phase_name(s) == "data"]
    if len(starts) < 2:
        raise ValueError(f"the trace holds {len(starts)} step(s) marked by {PHASE_PREFIX}data "
                         f"spans; at least 2 are needed (profile more steps)")
    return Steps(starts, max(s.end for s in trace.phases))


def analyse(trace: Trace, samples_per_step: int | None = None, top: int = 10) -> dict:
    """The figures of the module doc as a flat-ish dict (milliseconds per step, % of the
    step); ``steps`` counts the analysed steps (all but the anchor)."""
    steps = steps_of(trace)
    n = steps.count - 1
    host_start, host_end = steps.starts[1], steps.end
    on_device = bool(trace.device)
    result: dict = {"device": "cuda" if on_device else "cpu", "steps": n}
    phase_host = collections.defaultdict(float)
    data_spans = []
    for s in trace.phases:
        if steps.index(s.start) >= 1:
            phase_host[phase_name(s)] += s.dur
            if phase_name(s) == "data":
                data_spans.append((s.start, s.end))
    data_merged = merge(data_spans)
    syncs = [(s.start, s.end) for s in trace.syncs if host_start <= s.start < host_end]
    blocked = overlap(host_start, host_end, merge(syncs))
    data_host = sum(b - a for a, b in data_merged)
    # The host's own work: the steps less its waits, in the loader or in a synchronizing
    # call (a wait inside the loader counts once).
    waiting = overlap(host_start, host_end, merge(syncs + data_spans))
    # The loader's own operators (a DataLoader without workers transforms its samples in
    # the step's thread, inside the data span) are the wait for data, not the step's.
    ops, loader_ops = _split_loader_ops(
        [o for o in trace.ops if host_start <= o.start < host_end],
        [s for s in trace.phases if phase_name(s) == "data" and steps.index(s.start) >= 1])
    op_self = self_times(ops)
    top_ops = sorted(op_self.items(), key=lambda kv: -kv[1])[:top]
    result["top_operators"] = [{"name": k, "ms_per_step": v / 1e3 / n} for k, v in top_ops]
    result["phases_host_ms"] = {p: v / 1e3 / n for p, v in phase_host.items()}

    if not on_device:
        step_us = (host_end - host_start) / n
        by_kind = collections.defaultdict(float)
        for name, us in op_self.items():
            if name.startswith("aten::"):
                by_kind[classify(name)] += us
        op_total = sum(by_kind.values())
        comm = overlap(host_start, host_end,
                       merge([(c.start, c.end) for c in trace.collectives]))
        result.update(
            comm_ms=comm / 1e3 / n, comm_pct=100 * comm / (host_end - host_start),
            step_ms=step_us / 1e3, host_ms=step_us / 1e3,
            data_pct=100 * data_host / (host_end - host_start),
            operator_ms=op_total / 1e3 / n,
            operator_pct=100 * op_total / (host_end - host_start),
            by_kind_ms={k: by_kind.get(k, 0.0) / 1e3 / n for k in CATEGORIES},
            ops_per_step=len(ops) / n, data_ops_per_step=len(loader_ops) / n)
        _per_sample(result, samples_per_step)
        return result

    # The device rows: the work launched by the analysed steps (by its launch's host time).
    # A kernel whose launch the trace does not hold was launched before the profiler
    # started (a host that runs ahead of the GPU: a CUDA graph's replays queued), and
    # belongs to no analysed step; only where the trace holds no launches at all is a kernel
    # placed by when it ran.
    launch_time = {c: r.start for c, r in trace.runtime.items()}
    graph_corr = {c for c, r in trace.runtime.items() if r.name in GRAPH_LAUNCHES}

    def step_of(span: Span) -> int:
        t = trace.called.get(span.correlation)
        if t is not None:
            return steps.index(t)
        return -1 if trace.called else steps.index(span.start)

    anchor = [d for d in trace.device if step_of(d) == 0]
    work = [d for d in trace.device if step_of(d) >= 1]
    if not work:
        raise ValueError("no device work was launched by the profiled steps")
    start = max(host_start, max((d.end for d in anchor), default=host_start))
    end = max(max(d.end for d in work), host_end)
    window = end - start
    busy_merged = merge([(max(d.start, start), d.end) for d in work if d.end > start])
    busy = sum(b - a for a, b in busy_merged)
    idle = {"data": 0.0, "host": 0.0, "other": 0.0}
    # Gaps, each with the kernel after it (the window's end closes the last).
    ordered = sorted((d for d in work if d.end > start), key=lambda d: d.start)
    prev_end, prev = start, None
    for d in [*ordered, None]:
        gap_end = end if d is None else d.start
        if gap_end > prev_end:
            waiting_data = overlap(prev_end, gap_end, data_merged)
            rest = gap_end - prev_end - waiting_data
            idle["data"] += waiting_data
            if d is not None and _launched_late(d, prev, prev_end, launch_time, graph_corr):
                idle["host"] += rest
            else:
                idle["other"] += rest
        if d is not None and d.end > prev_end:
            prev_end, prev = d.end, d
    kernels = [d for d in work if d.cat == "kernel"]
    launches = [r for r in trace.runtime.values() if steps.index(r.start) >= 1]
    by_kind = collections.defaultdict(float)
    by_class = collections.defaultdict(float)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    phase_device = collections.defaultdict(float)
    phase_at = [(s.start, s.end, phase_name(s)) for s in trace.phases]
    for d in work:
        by_kind[classify(d.name)] += d.dur
        by_class[kernel_class(d.name)] += d.dur
        by_name[d.name][0] += d.dur
        by_name[d.name][1] += 1
        phase_device[_phase_of(d, launch_time, graph_corr, phase_at)] += d.dur
    # The union of the collectives' kernels (two streams' at once count once): a share of
    # the step's wall time, never above it.
    comm = sum(b - a for a, b in merge([(max(d.start, start), min(d.end, end)) for d in work
                                        if "nccl" in d.name.lower() and d.end > start]))
    kernel_time = sum(by_kind.values()) or 1.0
    host_busy = max(0.0, (host_end - host_start) - waiting)
    result.update(
        step_ms=window / 1e3 / n,
        busy_pct=100 * busy / window, device_ms=busy / 1e3 / n,
        idle_data_pct=100 * idle["data"] / window, idle_host_pct=100 * idle["host"] / window,
        idle_other_pct=100 * idle["other"] / window,
        data_pct=100 * idle["data"] / window,
        host_ms=host_busy / 1e3 / n, host_blocked_ms=blocked / 1e3 / n,
        host_data_ms=data_host / 1e3 / n,
        kernels_per_step=len(kernels) / n, launches_per_step=len(launches) / n,
        graph_replays_per_step=sum(1 for r in launches if r.name in GRAPH_LAUNCHES) / n,
        by_kind_ms={k: by_kind.get(k, 0.0) / 1e3 / n for k in CATEGORIES},
        by_kind_pct={k: 100 * by_kind.get(k, 0.0) / kernel_time for k in CATEGORIES},
        by_class_ms={k: by_class.get(k, 0.0) / 1e3 / n for k in KERNEL_CLASSES},
        comm_pct=100 * comm / window,
        phases_device_ms={p: v / 1e3 / n for p, v in phase_device.items()},
        top_kernels=[{"name": k, "ms_per_step": v[0] / 1e3 / n, "launches_per_step": v[1] / n}
                     for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]])
    attention = collections.defaultdict(float)
    for name, (us, _) in by_name.items():
        attention[attention_kind(name)] += us
    result["attention_ms"] = {k: attention.get(k, 0.0) / 1e3 / n for k in ("fused", "softmax")}
    # Host-to-device copies (kineto's "Memcpy HtoD (Pageable -> Device)"): from pageable
    # memory the copy is staged by the driver and the host waits for it.
    h2d = [d for d in work if d.cat == "gpu_memcpy" and "htod" in d.name.lower()]
    result.update(h2d_ms=sum(d.dur for d in h2d) / 1e3 / n,
                  h2d_pageable=any("pageable" in d.name.lower() for d in h2d))
    _per_sample(result, samples_per_step)
    return result


def _split_loader_ops(ops: list[Span], data: list[Span]) -> tuple[list[Span], list[Span]]:
    """``ops`` split into those of the step and those that began inside a ``data`` span on
    their own thread (the loader's, while the step waited for its batch)."""
    spans: dict = collections.defaultdict(list)
    for s in data:
        spans[s.tid].append((s.start, s.end))
    spans = {tid: merge(v) for tid, v in spans.items()}
    step, loader = [], []
    for o in ops:
        merged = spans.get(o.tid, ())
        i = bisect.bisect_right(merged, (o.start, float("inf"))) - 1
        (loader if i >= 0 and o.start < merged[i][1] else step).append(o)
    return step, loader


def _launched_late(kernel: Span, prev: Span | None, prev_end: float, launch_time: dict,
                   graph_corr: set) -> bool:
    """HTA's rule, aware of graph replays: the device waited for the host when the work after
    the gap was launched after the device ran dry; within one graph replay, never."""
    corr = kernel.correlation
    if corr in graph_corr and prev is not None and prev.correlation == corr:
        return False
    launched = launch_time.get(corr)
    return launched is not None and launched >= prev_end


def _phase_of(d: Span, launch_time: dict, graph_corr: set, phase_at: list) -> str:
    """The phase whose host span launched ``d``; for a graph-replayed kernel, by its name."""
    if d.correlation in graph_corr:
        if classify(d.name) == "optimizer":
            return "update"
        low = d.name.lower()
        return "backward" if any(k in low for k in _BACKWARD) else "forward"
    t = launch_time.get(d.correlation)
    if t is None:
        return "other"
    i = bisect.bisect_right(phase_at, (t, float("inf"), "")) - 1
    while i >= 0 and phase_at[i][1] < t:
        i -= 1
    return phase_at[i][2] if i >= 0 else "other"


def _per_sample(result: dict, samples_per_step: int | None) -> None:
    if samples_per_step:
        result["samples_per_step"] = samples_per_step
        result["samples_per_s"] = samples_per_step / (result["step_ms"] / 1e3)
