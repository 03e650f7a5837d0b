"""Always-on phase timing: where each training step's time goes -- data wait, host-to-device
copy, forward, backward, optimizer update, other -- measured on every step at a cost kept
under 1% of throughput (``benchmarks/phase_overhead.py`` measures it; docs/benchmarks.md
records it).

A step is cut by *marks*: ``clock.mark("forward")`` says "the forward phase begins now"; the
time until the next mark belongs to that phase, so marks made several times per call (several
optimizer steps per call) add up, and the phases of a step add up to the step exactly. The
step runs from one ``mark("data")`` (the Updater's, before it asks the loader for a batch) to
the next.

- CPU: marks read the monotonic clock (``time.perf_counter``).
- CUDA: marks record CUDA events on the current stream, read back a step or more later with
  ``Event.query()`` (never a synchronize in the hot path). Not every step is timed: a timed
  step costs tens of microseconds of host time, so at most one step in 16
  (``PhaseClock.CUDA_SAMPLE_EVERY``) and at most one per 20 ms of wall-clock time
  (``CUDA_SAMPLE_PERIOD_S``) is, which keeps the cost well under 1% of a 1 ms step and of a
  0.1 ms one (a CUDA-graph step). A phase's time is then the time the
  *device* spent between two marks, gaps included: a device that waits while the host is
  inside the loader sees a long ``data`` phase; one busy with the previous step while the
  host waits does not (the wait is hidden, as it costs no throughput); a host too slow to
  launch kernels shows as long forward and backward phases.

The step function is marked only where it runs eagerly (``StandardStep``, reached through
wrappers that declare ``passes_marks``); a step captured as one CUDA graph is one ``compute``
phase (``kasoku profile`` splits it from a profiled window).

Written here rather than with torch.profiler: the profiler costs far more than 1% and keeps
every event; this keeps six numbers per step.
"""
from __future__ import annotations

import collections
import time

import torch

PHASES = ("data", "h2d", "forward", "backward", "update", "allreduce", "compute", "other")
"""Phase names in step order. ``compute``: forward, backward and update unsplit (a step
captured as a CUDA graph); ``allreduce``: the gradient exchange of data-parallel runs."""

SPLIT_PHASES = ("forward", "backward", "update")


def no_mark(phase: str) -> None:
    """The mark of a step that nobody times."""


def markable(step_fn):
    """The eager step under ``step_fn`` that takes marks (has a ``mark`` attribute), reached
    through wrappers declaring ``passes_marks = True`` (their inner step is ``step_fn``);
    None when a wrapper that does not pass them (a CUDA graph) is in the way."""
    fn = step_fn
    while fn is not None:
        if hasattr(fn, "mark"):
            return fn
        fn = getattr(fn, "step_fn", None) if getattr(fn, "passes_marks", False) else None
    return None


class PhaseClock:
    """Marks and per-phase totals for one device; see the module doc.

    ``mark(phase)`` begins a phase; ``step()`` ends the step under way (at the next step's
    ``mark("data")``, the Updater calls it). ``take()`` returns the phases of the steps finished
    since the last ``take`` (on CUDA: those whose events completed) as ``{"time/PHASE": ms per
    step, "time/PHASE%": % of the step, "time/step": ms}`` and starts over.
    """

    CUDA_SAMPLE_EVERY = 16
    """On CUDA at most one step in this many is timed: a timed step records about eight events
    and reads them back, tens of microseconds of host time, 11% of a 1.2 ms step when every
    step is timed (measured: benchmarks/phase_overhead.py, docs/benchmarks.md)."""

    CUDA_SAMPLE_PERIOD_S = 0.02
    """...and at most one per this many seconds of wall-clock time, so that short steps (a
    0.1 ms CUDA-graph step) are not timed more often in time than long ones."""

    def __init__(self, device, sample_every: int | None = None,
                 sample_period_s: float | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sample_every = sample_every or (self.CUDA_SAMPLE_EVERY if self.cuda else 1)
        self.sample_period_s = (sample_period_s if sample_period_s is not None
                                else self.CUDA_SAMPLE_PERIOD_S if self.cuda else 0.0)
        self._next_count, self._next_time = self.sample_every, 0.0  # step 0 is timed
        self._totals: dict[str, float] = collections.defaultdict(float)  # seconds
        self._steps = 0
        self._run_totals: dict[str, float] = collections.defaultdict(float)
        self._run_steps = 0
        self._count, self._on = 0, True
        if self.cuda:
            self._free: list = []
            self._marks: list[tuple[str, torch.cuda.Event]] = []
            self._pending: collections.deque = collections.deque()
        else:
            self._phase, self._since = None, None
            self._current: dict[str, float] = collections.defaultdict(float)

    # --- the hot path -------------------------------------------------------------------
    def mark(self, phase: str) -> None:
        if not self._on:
            return
        if self.cuda:
            self._marks.append((phase, self._record()))
            return
        now = time.perf_counter()
        if self._phase is not None:
            self._current[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def _record(self):
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self) -> None:
        """End the step under way; call it just before the next step's first ``mark``."""
        self._count += 1
        if self.cuda:
            if self._marks:  # the step was timed: its end is now
                self._pending.append((self._marks, self._record()))
                self._marks = []
                self._drain()
            self._on = False
            if self._count >= self._next_count:
                now = time.perf_counter()
                if now >= self._next_time:
                    self._on = True
                    self._next_count = self._count + self.sample_every
                    self._next_time = now + self.sample_period_s
            return
        if self._phase is not None:
            now = time.perf_counter()
            self._current[self._phase] += now - self._since
            self._since = now
            totals = self._totals
            for phase, seconds in self._current.items():
                totals[phase] += seconds
            self._current.clear()
            self._steps += 1

    def _drain(self) -> None:
        # Steps whose end event has completed (query: no synchronize).
        pending = self._pending
        while pending and pending[0][1].query():
            marks, end = pending.popleft()
            for (phase, start), (_, stop) in zip(marks, [*marks[1:], (None, end)]):
                self._totals[phase] += start.elapsed_time(stop) / 1e3
            self._steps += 1
            self._free.extend(e for _, e in marks)
            self._free.append(end)

    # --- read-out -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps measured and not yet taken."""
        return self._steps

    def take(self) -> dict[str, float]:
        """See the class doc; ``{}`` when no step finished since the last take."""
        if self.cuda:
            self._drain()
        if not self._steps:
            return {}
        out = summarize(self._totals, self._steps)
        for phase, seconds in self._totals.items():
            self._run_totals[phase] += seconds
        self._run_steps += self._steps
        self._totals.clear()
        self._steps = 0
        return out

    def run_summary(self) -> dict[str, float]:
        """What every ``take`` so far returned, over all their steps (``{}`` before one)."""
        return summarize(self._run_totals, self._run_steps) if self._run_steps else {}


class NoClock:
    """A clock that times nothing (phase timing off)."""
    cuda = False
    steps = 0

    def mark(self, phase: str) -> None:
        pass

    def step(self) -> None:
        pass

    def take(self) -> dict:
        return {}

    def run_summary(self) -> dict:
        return {}


def summarize(totals: dict[str, float], steps: int) -> dict[str, float]:
    """``{"time/step": ms, "time/PHASE": ms, "time/PHASE%": %}`` from seconds per phase over
    ``steps`` steps; phases that took no time are left out."""
    step_s = sum(totals.values())
    out = {"time/step": 1e3 * step_s / steps}
    for phase in PHASES:
        seconds = totals.get(phase, 0.0)
        if seconds > 0:
            out[f"time/{phase}"] = 1e3 * seconds / steps
            out[f"time/{phase}%"] = 100.0 * seconds / step_s if step_s else 0.0
    return out


def format_phases(times: dict[str, float]) -> str:
    """One line: ``step 12.3 ms = data 0.1 (1%) + forward 4.0 (33%) + ...``."""
    if "time/step" not in times:
        return "no step timed"
    parts = [f"{p} {times[f'time/{p}']:.3g} ({times[f'time/{p}%']:.0f}%)"
             for p in PHASES if f"time/{p}" in times]
    return f"step {times['time/step']:.3g} ms = " + " + ".join(parts)
