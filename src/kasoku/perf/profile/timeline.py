"""A picture of a few profiled steps, as the NVVP screenshots of old showed them: a *host* row
with kasoku's phase spans coloured by phase and, on a GPU, a *device* row with every kernel,
copy and fill coloured by the phase that launched it, so that an idle device shows as white
between the boxes. A CPU trace has no device: its second row holds the top-level operators
(coloured by kind), and the white between them is Python and dispatch.

The kernel-to-phase rule is ``trace.analyse``'s: a kernel's correlation id names its launch
call, and the launch's host time falls inside one phase span; kernels replayed from a CUDA
graph all carry the graph launch's id and are split by name (forward, backward, update).

Boxes are drawn with one ``broken_barh`` per colour and row, so a window of thousands of
kernels stays one collection per colour; a box narrower than a pixel is drawn faint (Agg's
coverage), so a row of short kernels with long gaps reads as mostly idle, which it is.

Perfetto shows the same trace in full; this is the one picture a report can embed.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

from kasoku.perf.profile.kernels import classify
from kasoku.perf.profile.trace import GRAPH_LAUNCHES, Span, Trace, _phase_of, phase_name

PHASE_COLORS = {
    "data": "#8c8c8c", "h2d": "#17becf", "forward": "#1f77b4", "backward": "#ff7f0e",
    "update": "#2ca02c", "kfac_factors": "#e377c2", "kfac_inverse": "#8c564b",
    "kfac_precondition": "#c49c94", "allreduce": "#d62728", "compute": "#9467bd",
    "other": "#bcbd22",
}
"""One fixed colour per phase of ``phases.PHASES`` (the same phase has the same colour in
every report)."""

KIND_COLORS = {
    "conv/matmul": "#393b79", "triton": "#637939", "optimizer": "#8c6d31",
    "copy/fill": "#843c39", "other": "#7b4173",
}
"""CPU operators by ``kernels.classify`` kind (``kernels.CATEGORIES``): darker shades, apart
from the phase colours."""


@dataclass
class Window:
    """The drawn part of a trace, in the trace's microseconds."""
    start: float
    end: float
    boundaries: list[float]
    """Host start of each drawn step, then where the last one ended."""
    first: int
    """The trace's index (0-based) of the first drawn step."""


def phase_of(name: str) -> str:
    """The phase a ``kasoku/NAME`` span's NAME stands for; unknown names count as other."""
    return name if name in PHASE_COLORS else "other"


def window(trace: Trace, steps: int = 3) -> Window:
    """``steps`` consecutive steps: the 2nd to the (steps+1)th when the trace has that many
    (the first is skipped: on a GPU it may have queued work before the trace began), else all
    of them. On a GPU the window runs on until the device finished the work its steps
    launched."""
    if not trace.phases:
        raise ValueError("the trace holds no kasoku/ phase spans: nothing to draw")
    starts = [s.start for s in trace.phases if phase_name(s) == "data"] \
        or [trace.phases[0].start]
    host_end = max(s.end for s in trace.phases)
    steps = max(1, steps)
    first = 1 if len(starts) > steps else 0
    last = min(first + steps, len(starts))
    end = starts[last] if last < len(starts) else host_end
    start = starts[first]
    boundaries = [*starts[first:last], end]
    finished = [d.end for d in trace.device if start <= _launch_time(d, trace) < end]
    if finished:
        end = max(end, max(finished))
    return Window(start, end, boundaries, first)


def _launch_time(d: Span, trace: Trace) -> float:
    r = trace.runtime.get(d.correlation)
    return r.start if r is not None else d.start


def device_phases(trace: Trace) -> list[str]:
    """The phase that launched each of ``trace.device`` (same order), as ``analyse`` assigns
    it; graph-replayed kernels by name."""
    launch_time = {c: r.start for c, r in trace.runtime.items()}
    graph_corr = {c for c, r in trace.runtime.items() if r.name in GRAPH_LAUNCHES}
    phase_at = [(s.start, s.end, phase_name(s)) for s in trace.phases]
    return [phase_of(_phase_of(d, launch_time, graph_corr, phase_at)) for d in trace.device]


def top_level(ops: list[Span]) -> list[Span]:
    """The operators not inside another on their thread (``ops`` sorted by start, longest
    first, as ``trace.parse`` leaves them)."""
    out, open_until = [], {}
    for op in ops:
        if op.start >= open_until.get(op.tid, float("-inf")):
            out.append(op)
            open_until[op.tid] = op.end
    return out


def _boxes(spans, keys, start: float, end: float) -> dict[str, list[tuple[float, float]]]:
    """``(x, width)`` in ms from ``start`` per key, clipped to ``[start, end]``."""
    out: dict[str, list] = collections.defaultdict(list)
    for span, key in zip(spans, keys):
        a, b = max(span.start, start), min(span.end, end)
        if b > a:
            out[key].append(((a - start) / 1e3, (b - a) / 1e3))
    return out


def _rows(trace: Trace, w: Window) -> list[tuple[str, dict]]:
    """``(label, {colour: boxes})`` from the top row down."""
    host = _boxes(trace.phases, [PHASE_COLORS[phase_of(phase_name(s))] for s in trace.phases],
                  w.start, w.end)
    rows = [("host", host)]
    if trace.device:
        colors = [PHASE_COLORS[p] for p in device_phases(trace)]
        streams = sorted({d.tid for d in trace.device}, key=str)
        for stream in streams:
            picked = [(d, c) for d, c in zip(trace.device, colors) if d.tid == stream]
            label = "device" if len(streams) == 1 else f"device\nstream {stream}"
            rows.append((label, _boxes([d for d, _ in picked], [c for _, c in picked],
                                       w.start, w.end)))
        return rows
    # Operators of the training thread(s): those that run the phases.
    tids = {s.tid for s in trace.phases}
    ops = top_level([o for o in trace.ops if o.tid in tids] or trace.ops)
    rows.append(("operators", _boxes(ops, [KIND_COLORS[classify(o.name)] for o in ops],
                                     w.start, w.end)))
    return rows


def draw_timeline(trace: Trace, path, steps: int = 3, title: str = "",
                  first_step: int = 1) -> Path:
    """Write the PNG picture of ``steps`` steps of ``trace`` (see ``window``) to ``path``
    and return it as a ``Path``. x: milliseconds from the first drawn step's start; thin
    vertical lines at the step boundaries (host time). ``first_step``: the number the
    trace's first step is labelled with (a script's own step number)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    w = window(trace, steps)
    rows = _rows(trace, w)
    fig = Figure(figsize=(14, 1.3 + 0.55 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used = set()
    for i, (label, boxes) in enumerate(rows):
        y = len(rows) - 1 - i
        for color, xs in boxes.items():
            ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=color, linewidth=0)
            used.add(color)
    span_ms = (w.end - w.start) / 1e3
    for k, t in enumerate(w.boundaries):
        x = (t - w.start) / 1e3
        ax.axvline(x, color="black", linewidth=0.6, alpha=0.6)
        if k < len(w.boundaries) - 1:
            ax.text(x + span_ms * 0.003, len(rows) - 0.45, f"step {first_step + w.first + k}",
                    fontsize=7, va="bottom")
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.5, len(rows) - 0.5 + 0.3)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms from the first drawn step's start (white: idle)")
    ax.grid(axis="x", alpha=0.2)
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items() if c in used]
    handles += [Patch(color=c, label=f"op: {k}") for k, c in KIND_COLORS.items() if c in used]
    if handles:
        ax.legend(handles=handles, fontsize=7, ncols=min(len(handles), 10),
                  loc="upper center", bbox_to_anchor=(0.5, -0.3 if len(rows) < 3 else -0.2),
                  frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path
