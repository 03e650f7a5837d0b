"""Triggers decide when an extension runs. They are stateless functions of the progress before
and after the step (``trainer.updater.previous_*`` and the current counters), so a resumed run
fires at exactly the iterations the uninterrupted run would have."""
from __future__ import annotations

import math
from typing import Callable

UNITS = ("iteration", "epoch")

_EPS = 1e-9
"""Absorbs float rounding of ``epoch_detail / period``: ``0.3 / 0.1`` is 2.9999999999999996,
and the boundary at 3 must count as crossed."""


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"trigger unit must be 'iteration' or 'epoch', got {unit!r}")


def _progress(trainer, unit: str) -> tuple[float, float]:
    """(before, after) the latest step, in ``unit``."""
    u = trainer.updater
    if unit == "iteration":
        return u.previous_iteration, u.iteration
    return u.previous_epoch_detail, u.epoch_detail


class IntervalTrigger:
    """Fires when ``floor(prev / period) != floor(now / period)``: every ``period``
    iterations, or whenever the progress crosses a multiple of ``period`` epochs (``period``
    may be fractional for epochs)."""

    def __init__(self, period: float, unit: str):
        _check_unit(unit)
        if not period > 0:
            raise ValueError(f"trigger period must be positive, got {period}")
        if unit == "iteration" and period != int(period):
            raise ValueError(f"an iteration period must be a whole number, got {period}")
        self.period = int(period) if unit == "iteration" else float(period)
        self.unit = unit

    def interval_index(self, progress: float) -> int:
        """Number of whole periods in ``progress``."""
        if self.unit == "iteration":
            return int(progress) // self.period
        return math.floor(progress / self.period + _EPS)

    def fires(self, prev: float, now: float) -> bool:
        return self.interval_index(prev) != self.interval_index(now)

    def reached(self, trainer) -> bool:
        """True once the progress is at or past the first firing point (a stop trigger uses it
        to see that a resumed run has nothing left to do)."""
        return self.interval_index(_progress(trainer, self.unit)[1]) >= 1

    def __call__(self, trainer) -> bool:
        u = trainer.updater
        if self.unit == "iteration":  # the common case, called per extension per step: inline
            return u.previous_iteration // self.period != u.iteration // self.period
        return self.fires(u.previous_epoch_detail, u.epoch_detail)

    def __repr__(self) -> str:
        return f"IntervalTrigger({self.period}, {self.unit!r})"


class ManualScheduleTrigger:
    """Fires on the step whose progress passes one of ``points``: ``prev < p <= now``."""

    def __init__(self, points, unit: str):
        _check_unit(unit)
        self.points = sorted(points) if isinstance(points, (list, tuple)) else [points]
        self.unit = unit

    def fires(self, prev: float, now: float) -> bool:
        return any(prev + _EPS < p <= now + _EPS for p in self.points)

    def reached(self, trainer) -> bool:
        return _progress(trainer, self.unit)[1] + _EPS >= self.points[0]

    def __call__(self, trainer) -> bool:
        return self.fires(*_progress(trainer, self.unit))

    def __repr__(self) -> str:
        return f"ManualScheduleTrigger({self.points}, {self.unit!r})"


def never_fire(trainer) -> bool:
    return False


def get_trigger(spec) -> Callable:
    """A trigger from ``(N, "iteration" | "epoch")``, a trigger object or callable
    ``f(trainer) -> bool`` (returned as is), or None (never fires)."""
    if spec is None:
        return never_fire
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"a trigger is (N, 'iteration') or (N, 'epoch'), got {spec!r}")
        return IntervalTrigger(*spec)
    if callable(spec):
        return spec
    raise TypeError(f"a trigger is (N, 'iteration'), (N, 'epoch') or a callable, got {spec!r}")
