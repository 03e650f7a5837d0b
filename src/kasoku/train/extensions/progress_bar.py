"""ProgressBar: iteration and epoch progress, iterations/s, samples/s and ETA, on stderr."""
from __future__ import annotations

import math
import sys
import time

from kasoku.train.reporter import PRIORITY_READER
from kasoku.train.triggers import IntervalTrigger


class ProgressBar:
    """A live ``rich`` bar when ``out`` (default stderr) is a terminal, else one plain line
    every ``plain_interval`` seconds (logs and CI stay readable).

    Cheap by design: each iteration costs one clock read and a comparison; drawing happens at
    most every ``update_interval`` seconds and reads only host-side counters (no device sync),
    so on a GPU the rate is the rate at which steps are queued, which equals the device rate
    once the queue is full. ETA is known when the stop trigger is an ``IntervalTrigger``.
    ``unit``: what a sample is called in the rate (``images`` for an image model);
    ``units_per_sample``: how many of them a sample holds (a language model's sequence of
    ``block_size`` tokens, counted in tokens/s).
    """
    trigger = (1, "iteration")
    priority = PRIORITY_READER - 10
    name = "ProgressBar"

    def __init__(self, update_interval: float = 0.25, plain_interval: float = 5.0, out=None,
                 unit: str = "samples", units_per_sample: int = 1):
        self.update_interval, self.plain_interval, self.out = update_interval, plain_interval, out
        self.unit, self.units_per_sample = unit, units_per_sample
        self._progress = None

    def initialize(self, trainer) -> None:
        self._stream = self.out or sys.stderr
        u = trainer.updater
        self._total = _total_iterations(trainer.stop_trigger, u.batches_per_epoch)
        self._last_t, self._last_it, self._last_samples = time.perf_counter(), u.iteration, \
            u.samples
        self._rate = self._sample_rate = None
        self._tty = tty = getattr(self._stream, "isatty", lambda: False)()
        self._interval = self.update_interval if tty else self.plain_interval
        self._next_draw = self._last_t + self._interval
        if tty:
            self._start_rich(u.iteration)

    def _start_rich(self, iteration: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(),
                                  TextColumn("{task.description}"),
                                  console=Console(file=self._stream), auto_refresh=False,
                                  transient=False)
        self._task = self._progress.add_task("", total=self._total, completed=iteration)
        self._progress.start()

    def __call__(self, trainer) -> None:
        now = time.perf_counter()
        if now < self._next_draw:
            return
        self._next_draw = now + self._interval
        self._draw(trainer, now)

    def _draw(self, trainer, now: float) -> None:
        u = trainer.updater
        if now > self._last_t and u.iteration > self._last_it:
            self._rate = (u.iteration - self._last_it) / (now - self._last_t)
            self._sample_rate = (self.units_per_sample * (u.samples - self._last_samples)
                                 / (now - self._last_t))
        self._last_t, self._last_it, self._last_samples = now, u.iteration, u.samples
        text = self.status(u.iteration, u.epoch_detail, self._rate, self._sample_rate)
        if self._progress is not None:
            self._progress.update(self._task, completed=u.iteration, description=text)
            self._progress.refresh()
        else:
            print(text, file=self._stream, flush=True)

    def status(self, iteration: int, epoch_detail: float, rate: float | None,
               sample_rate: float | None = None) -> str:
        """One line: ``iteration 120/600  epoch 0.20  52.1 it/s  5210 samples/s  ETA 0:00:09``
        (the samples the steps took per second: a short last batch counts what it holds)."""
        total = f"/{self._total}" if self._total else ""
        parts = [f"iteration {iteration}{total}", f"epoch {epoch_text(epoch_detail, iteration)}"]
        if rate:
            parts.append(f"{rate:.1f} it/s")
            if sample_rate:
                parts.append(f"{sample_rate:,.0f} {self.unit}/s")
            if self._total:
                parts.append(f"ETA {_hms(max(0, self._total - iteration) / rate)}")
        return "  ".join(parts)

    def finalize(self, trainer) -> None:
        if self._tty and self._progress is None:
            return  # stopped by on_error
        if trainer.updater.iteration != self._last_it:
            self._draw(trainer, time.perf_counter())
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_error(self, trainer, exc) -> None:
        if self._progress is not None:  # leave the terminal usable for the traceback
            self._progress.stop()
            self._progress = None


def _total_iterations(stop_trigger, batches_per_epoch: int) -> int | None:
    if not isinstance(stop_trigger, IntervalTrigger):
        return None
    if stop_trigger.unit == "iteration":
        return stop_trigger.period
    return math.ceil(stop_trigger.period * batches_per_epoch - 1e-9)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def epoch_text(epoch_detail: float, iteration: int) -> str:
    """The epoch with as many decimals as one iteration moves it (2 to 6): a long epoch's
    first iterations (gpt's, thousands to an epoch) read ``epoch 0.0029``, not ``epoch 0.00``
    line after line."""
    digits = 2
    if iteration > 0 and epoch_detail > 0:
        digits = min(6, max(2, math.ceil(-math.log10(epoch_detail / iteration))))
    return f"{epoch_detail:.{digits}f}"
