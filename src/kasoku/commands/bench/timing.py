"""Timing shared by every rung, the plain loop included: a span of steps timed with CUDA events
and one synchronize on a GPU, with ``perf_counter`` on a CPU (whose operators are synchronous).

A ``Runner`` runs one training step per batch it is given and returns the last step's loss as
a detached 0-dim tensor (no host sync inside).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from kasoku.commands.bench.pool import Batch, cycle
from kasoku.perf.noise import spread

Runner = Callable[[list[Batch]], torch.Tensor]


def timed(device: torch.device, fn: Callable[[], object]) -> tuple[object, float]:
    """``(fn(), seconds)`` with the device's work finished inside the span."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()  # note: the one host sync of a window
        return result, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


@dataclass
class Measurement:
    batch_size: int
    window_s: list[float] = field(default_factory=list)
    steps_per_window: int = 0

    @property
    def samples_per_s(self) -> list[float]:
        return [self.batch_size * self.steps_per_window / s for s in self.window_s]

    def figures(self) -> dict:
        rates = self.samples_per_s
        step_ms = [1e3 * s / self.steps_per_window for s in self.window_s]
        return {
            "samples_per_s": {"median": statistics.median(rates), "min": min(rates),
                              "max": max(rates), "n": len(rates)},
            "step_time_ms": {"median": statistics.median(step_ms), "min": min(step_ms),
                             "max": max(step_ms)},
            "steps_per_window": self.steps_per_window,
        }


def measure_windows(runner: Runner, pool: list[Batch] | None, device: torch.device,
                    batch_size: int, steps: int, windows: int, start: int = 0,
                    batches: Callable[[int, int], Iterable[Batch]] | None = None
                    ) -> tuple[Measurement, torch.Tensor]:
    """Time ``windows`` spans of ``steps`` steps each; returns the measurement and the last
    loss. The batches come from ``pool`` (their lists built before each span starts) or from
    ``batches(n, start)`` (an iterable a loader may fill lazily, inside the span)."""
    if steps < 1 or windows < 1:
        raise ValueError(f"steps and windows must be >= 1, got {steps} and {windows}")
    m = Measurement(batch_size, steps_per_window=steps)
    loss = None
    for w in range(windows):
        span = (cycle(pool, steps, start + w * steps) if batches is None
                else batches(steps, start + w * steps))
        loss, seconds = timed(device, lambda: runner(span))
        m.window_s.append(seconds)
    return m, loss


EXTRA_WINDOWS = 2
"""Unstable windows are followed by up to this many times as many windows again..."""
EXTRA_BUDGET_S = 20.0
"""... within this many seconds (and never more than the windows asked for took, twice)."""


def settle(runner: Runner, device: torch.device, m: Measurement, start: int,
           batches: Callable[[int, int], Iterable[Batch]]) -> int:
    """While ``m``'s windows disagree (``kasoku.perf.noise.spread``), time more windows of
    the same steps, up to ``EXTRA_WINDOWS`` x the windows taken and within a bounded time;
    returns how many were added. From 6 windows on the fastest and slowest are left out of
    the spread, so a window disturbed once no longer decides it."""
    asked, budget = len(m.window_s), min(EXTRA_BUDGET_S, 2 * sum(m.window_s))
    added, spent = 0, 0.0
    while (not spread(m.samples_per_s).stable and added < EXTRA_WINDOWS * asked
           and spent < budget):
        steps = m.steps_per_window
        span = batches(steps, start + (asked + added) * steps)
        _, seconds = timed(device, lambda: runner(span))
        m.window_s.append(seconds)
        added, spent = added + 1, spent + seconds
    return added


def graph_replay_ms(fn: Callable[[], object], replays: int = 20, windows: int = 5,
                    calls: int = 1) -> tuple[float, float]:
    """``calls`` calls of ``fn`` captured as one CUDA graph (after 3 eager calls on a side
    stream, as capture needs), then timed replaying: (median over ``windows`` of the
    milliseconds per call, each window ``replays`` replays between two CUDA events; seconds
    spent warming up and capturing). No host time is in the figure: for kernels alone."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return statistics.median(times), once
