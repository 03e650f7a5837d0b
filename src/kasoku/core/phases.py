"""Always-on phase timing: where each training step's time goes -- data wait, host-to-device
copy, forward, backward, optimizer update, the phases a part above declares (K-FAC's curvature
work: ``declare_phases``), other -- measured on every step at a cost kept under 1% of
throughput (``benchmarks/phase_overhead.py`` measures it; docs/benchmarks.md records it).

A step is cut by *marks*: ``clock.mark("forward")`` says "the forward phase begins now"; the
time until the next mark belongs to that phase, so marks made several times per call (several
optimizer steps per call) add up, and the phases of a step add up to the step exactly. The
step runs from one ``mark("data")`` (the Updater's, before it asks the loader for a batch) to
the next. ``mark`` returns the phase it ended (None when this step is not timed), so that work
nested inside a phase -- K-FAC's factor products run in forward and backward hooks -- marks its
own phase and hands back: ``was = mark("kfac_factors"); ...; if was: mark(was)``. A mark
nobody times (``no_mark``) returns None and the hand-back is skipped: it costs one call.

- CPU: marks read the monotonic clock (``time.perf_counter``).
- CUDA: marks record CUDA events on the current stream, read back a step or more later with
  ``Event.query()`` (never a synchronize in the hot path). Not every step is timed: a timed
  step costs tens of microseconds of host time, so on average one step in 16 is timed
  (``PhaseClock.CUDA_SAMPLE_EVERY``), and no more than about one per 20 ms of wall-clock time
  (``CUDA_SAMPLE_PERIOD_S``), which keeps the cost well under 1% of a 1 ms step and of a
  0.1 ms one (a CUDA-graph step). A phase's time is then the time the
  *device* spent between two marks, gaps included: a device that waits while the host is
  inside the loader sees a long ``data`` phase; one busy with the previous step while the
  host waits does not (the wait is hidden, as it costs no throughput); a host too slow to
  launch kernels shows as long forward and backward phases.

Which steps are timed is drawn at random (``PhaseClock._draw``), not every 16th: steps that
differ on a schedule -- K-FAC's factor steps every N steps, its inverse steps every M -- would
alias with a fixed stride (every 16th step with N = 10 lands on a factor step 1 time in 5, not
1 in 10, and a stride of 20 on the same step of the cycle every time). A random draw times
every step with the same probability, whatever its place in any schedule, so the averages are
those of all steps (the 20 ms cap sets that probability per block of 256 steps, from their
mean step time, never from the time since the last timed step: ``PhaseClock._new_block``).
A short interval may still hold no inverse step, or several: read the run's average
(``run_summary``), or ``kasoku profile``, which times every step of whole K-FAC cycles.

The step function is marked only where it runs eagerly (``StandardStep``, reached through
wrappers that declare ``passes_marks``: ``kasoku.train.step.markable``); a step captured as
one CUDA graph is one ``compute`` phase (``kasoku profile`` splits it from a profiled window).

Written here rather than with torch.profiler: the profiler costs far more than 1% and keeps
every event; this keeps a few numbers per step.
"""
from __future__ import annotations

import collections
import collections.abc
import math
import random
import time
from typing import Callable, Protocol, runtime_checkable

import torch

STEP_PHASES = ("data", "h2d", "forward", "backward", "update")
"""The phases of every step, in step order."""
LAST_PHASES = ("allreduce", "compute", "other")
"""The phases after the declared ones (``declare_phases``). ``compute``: forward, backward and
update unsplit (a step captured as a CUDA graph); ``allreduce``: the gradient exchange of
data-parallel runs."""

_declared: list[str] = []


def declare_phases(names) -> tuple[str, ...]:
    """Declare the phases of work a part of kasoku above this layer times on its own (K-FAC's
    curvature work: ``kasoku.kfac.phases``), split out of the phases it runs in; returns them
    as a tuple. They come after ``update`` in ``PHASES`` (beside the update, though the work
    may run in forward and backward), in the order declared; declaring a name again changes
    nothing. A part declares its phases when it is imported, so they are known wherever its
    work is marked."""
    names = tuple(names)
    for name in names:
        if name in STEP_PHASES or name in LAST_PHASES:
            raise ValueError(f"phase {name!r} is one of the step's own; declare another name")
        if name not in _declared:
            _declared.append(name)
    return names


class _PhaseNames(collections.abc.Sequence):
    """Every phase name in step order: ``STEP_PHASES``, the declared ones, ``LAST_PHASES``.
    Read live, so that a module that imported ``PHASES`` before a declaration sees it."""

    def _names(self) -> tuple[str, ...]:
        return (*STEP_PHASES, *_declared, *LAST_PHASES)

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(STEP_PHASES) + len(_declared) + len(LAST_PHASES)

    def __repr__(self) -> str:
        return repr(self._names())


PHASES = _PhaseNames()
"""Phase names in step order (``_PhaseNames``)."""

SPLIT_PHASES = ("forward", "backward", "update")


def no_mark(phase: str) -> None:
    """The mark of a step that nobody times (returns None: no phase to hand back to)."""


@runtime_checkable
class TakesMarks(Protocol):
    """What marks phases on a clock it is handed: its ``mark`` (``no_mark`` until then) is set
    to the clock's. The eager step (``kasoku.train.step.StandardStep``, found through its
    wrappers by ``kasoku.train.step.markable``) and an optimizer that times phases of its own
    (K-FAC's) are."""
    mark: Callable[[str], str | None]


class PhaseClock:
    """Marks and per-phase totals for one device; see the module doc.

    ``mark(phase)`` begins a phase and returns the one it ended (None on a step not timed);
    ``step()`` ends the step under way (at the next step's ``mark("data")``, the Updater calls
    it). ``take()`` returns the phases of the steps finished since the last ``take`` (on CUDA:
    those whose events completed) as ``{"time/PHASE": ms per step, "time/PHASE%": % of the
    step, "time/step": ms}`` and starts over.

    ``sample_every`` (default: 16 on CUDA, 1 on a CPU) and ``sample_period_s`` (default: 20 ms
    on CUDA, 0 on a CPU) choose the timed steps on any device: each step is timed with
    probability ``1 / max(sample_every, sample_period_s / step time)`` (see ``_draw`` and
    ``_new_block``), drawn from a generator of its own seeded with ``seed``; 1 and 0 time
    every step.
    """

    CUDA_SAMPLE_EVERY = 16
    """On CUDA one step in this many is timed, on average: a timed step records about eight
    events and reads them back, tens of microseconds of host time, 11% of a 1.2 ms step when
    every step is timed (measured: benchmarks/phase_overhead.py, docs/benchmarks.md)."""

    CUDA_SAMPLE_PERIOD_S = 0.02
    """...and about one per this many seconds of wall-clock time, so that short steps (a
    0.1 ms CUDA-graph step) are not timed more often in time than long ones."""

    RATE_BLOCK_STEPS = 256
    """With ``sample_period_s``, the sampling rate is set anew every this many steps, from
    their mean host time per step (see ``_new_block``)."""

    def __init__(self, device, sample_every: int | None = None,
                 sample_period_s: float | None = None, seed: int = 0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sample_every = sample_every or (self.CUDA_SAMPLE_EVERY if self.cuda else 1)
        self.sample_period_s = (sample_period_s if sample_period_s is not None
                                else self.CUDA_SAMPLE_PERIOD_S if self.cuda else 0.0)
        self._every_step = self.sample_every == 1 and self.sample_period_s <= 0
        # Its own generator: the training's random streams are left alone.
        self._random = random.Random(seed)
        self._mean_gap = float(self.sample_every)
        # Steps until the next timed one (1: the next); the first gap is drawn as the others.
        self._countdown = 1 if self._every_step else self._draw(self._mean_gap)
        self._block_start = 0.0
        self._next_block = 1 if self.sample_period_s > 0 else math.inf
        self._totals: dict[str, float] = collections.defaultdict(float)  # seconds
        self._steps = 0
        self._run_totals: dict[str, float] = collections.defaultdict(float)
        self._run_steps = 0
        self._count, self._on = 0, self._every_step
        if self.cuda:
            self._free: list = []
            self._marks: list[tuple[str, torch.cuda.Event]] = []
            self._pending: collections.deque = collections.deque()
        else:
            self._phase, self._since = None, None
            self._current: dict[str, float] = collections.defaultdict(float)

    # --- the hot path -------------------------------------------------------------------
    def mark(self, phase: str) -> str | None:
        if not self._on:
            return None
        if self.cuda:
            marks = self._marks
            was = marks[-1][0] if marks else None
            marks.append((phase, self._record()))
            return was
        now = time.perf_counter()
        was = self._phase
        if was is not None:
            self._current[was] += now - self._since
        self._phase, self._since = phase, now
        return was

    def _record(self):
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self) -> None:
        """End the step under way; call it just before the next step's first ``mark``."""
        self._count += 1
        if self._on:
            self._end_step()
        if self._count >= self._next_block:
            self._new_block()
        self._countdown -= 1
        if self._countdown <= 0:
            self._countdown = 1 if self._every_step else self._draw(self._mean_gap)
            self._on = True
        else:
            self._on = False
            if not self.cuda:
                self._phase = None  # the untimed steps' time belongs to no phase

    def time_next(self) -> None:
        """Time the next step, whatever the draw (a short measured window then holds at
        least one timed step); the gaps after it are drawn as before."""
        self._countdown = 1

    def _end_step(self) -> None:
        if self.cuda:
            if self._marks:  # the step was timed: its end is now
                self._pending.append((self._marks, self._record()))
                self._marks = []
                self._drain()
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

    def _new_block(self) -> None:
        """Set the sampling rate from the mean host time per step of the block of
        ``RATE_BLOCK_STEPS`` steps just ended: one step in ``max(sample_every,
        sample_period_s / step time)``, on average. The gap under way is drawn anew (a
        geometric gap has no memory: each step is still timed with the block's probability).

        Per block, not per gap: a rate set from the steps since the last timed one (or a gate
        that waited 20 ms after it) would time sooner after a long step (a K-FAC inverse step)
        and so favour the steps that follow one; a block's rate is the same for all its steps,
        and blocks of many steps hold each kind of step at nearly its share."""
        now = time.perf_counter()
        if self._count > 1:
            step_s = (now - self._block_start) / self.RATE_BLOCK_STEPS
            if step_s > 0:
                self._mean_gap = max(float(self.sample_every), self.sample_period_s / step_s)
            self._countdown = self._draw(self._mean_gap)
        self._block_start = now
        self._next_block = self._count + self.RATE_BLOCK_STEPS

    def _draw(self, mean: float) -> int:
        """A geometric gap of mean ``mean`` (>= 1): each step is timed with probability
        1/mean, independently of the others, so the timed steps are a fair sample of all of
        them whatever schedule the steps follow (no aliasing; see the module doc)."""
        if mean <= 1:
            return 1
        u = self._random.random()  # in [0, 1): log(1 - u) is finite
        return 1 + int(math.log1p(-u) / math.log1p(-1.0 / mean))

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
        return None

    def step(self) -> None:
        pass

    def time_next(self) -> None:
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
