"""The timed steps of a script's profile (``kasoku.commands.script_watch``): steps timed
without the profiler, in windows each ended by a synchronize (the throughput, its spread and
the wait for data; the device the script trains on, a batch's samples). A module of its
own: the watch hooks the script, this times it.

A side of the A/B runs (``min_seconds``: the profile's ``--measure-seconds``) times its steps
for that long at least, as a workload's timed steps do (``profile_steps.time_steps``): 20 fast
steps last a tenth of a second, too short for the rounds' noise rule to tell a lever from the
noise. The steps it takes are known as its windows are timed: at each window's end those
left grow to the time at the pace so far (``MAX_MEASURE_STEPS`` at most). A script that ends
first has its steps timed to there, if at least the ``measure_steps`` asked (``close``).
"""
from __future__ import annotations

import math
import time

import torch

from kasoku.commands.profile_steps import MAX_MEASURE_STEPS, MEASURE_WINDOWS, sync
from kasoku.perf.noise import MachineWatch, Stability, job_pids, spread


class StepTimer:
    """Times ``steps`` steps (more for ``min_seconds``) on ``device`` from ``start``."""

    def __init__(self, device, steps: int, min_seconds: float = 0.0):
        self.device, self.asked, self.min_seconds = device, steps, min_seconds
        self.ends = _ends(steps, min(MEASURE_WINDOWS, steps))
        self.rates: list[float] = []
        self.wait_s = 0.0
        """Time in the DataLoader's ``__next__`` while timed (the watch adds it)."""
        self.done = 0
        self.losses: list = []
        """The timed steps' losses, as the script's backward passes took them (the watch adds
        them; read only in ``figures``: a read is a sync)."""
        sync(device)
        self.watch = MachineWatch(own=job_pids(), device=device).start()
        self.t0 = self.t = time.perf_counter()

    @property
    def target(self) -> int:
        """The steps to time, as planned now."""
        return self.ends[-1]

    def step(self, n: int) -> bool:
        """The ``n``-th timed step ended; True once it is the last."""
        if n not in self.ends:
            return False
        sync(self.device)  # note: sync, the window's device work inside its span
        now = time.perf_counter()
        self.rates.append((n - self.done) / (now - self.t))
        if now - self.t0 < self.min_seconds:
            self._grow(n, now - self.t0)
        self.t, self.done = now, n
        return n >= self.ends[-1]

    def _grow(self, n: int, seconds: float) -> None:
        """Plan the steps after ``n`` to last ``min_seconds`` in all at the pace so far (the
        first step's is slower: each window's end plans again), in the windows left of
        ``MEASURE_WINDOWS`` (one more past them, should the time not be reached yet)."""
        wanted = min(MAX_MEASURE_STEPS, math.ceil(self.min_seconds * n / seconds))
        if wanted > self.ends[-1]:
            left = wanted - n
            windows = min(left, max(1, MEASURE_WINDOWS - len(self.rates)))
            self.ends = [*(e for e in self.ends if e <= n), *(n + e for e in _ends(left, windows))]

    def close(self, n: int) -> bool:
        """The script ended after ``n`` timed steps: the last window ends there. False (not
        timed) under the ``measure_steps`` asked."""
        if n < self.asked:
            return False
        if n > self.done:
            self.ends = [e for e in self.ends if e < n] + [n]
            self.step(n)
        return True

    def figures(self, batch_size: int | None, levers: list) -> dict:
        """The timed steps' figures (``measure.json``'s)."""
        n, elapsed, batch = self.done, self.t - self.t0, batch_size or 1
        return {
            "measured_steps": n, "measure_s": elapsed, "steps_per_s": n / elapsed,
            "samples_per_s": batch * n / elapsed, "samples_per_step": batch,
            "window_rates": [batch * r for r in self.rates],
            "stability": Stability(spread([batch * r for r in self.rates]),
                                   self.watch.stop()).to_dict(),
            "phases": {"time/data%": min(100.0, 100.0 * self.wait_s / elapsed)},
            "levers": levers, "losses": [float(loss) for loss in self.losses]}


def _ends(steps: int, windows: int) -> list[int]:
    """The step that ends each of ``windows`` near-equal windows of ``steps``."""
    ends, total = [], 0
    for i in range(windows):
        total += steps // windows + (i < steps % windows)
        ends.append(total)
    return ends


def script_device() -> torch.device:
    """The device the script trains on: the current GPU if it has started CUDA, else the
    CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch_size_of(batch) -> int | None:
    """The length of the first tensor in a batch (a tensor, or lists, tuples and dicts of
    them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def alloc_retries() -> int:
    """The CUDA caching allocator's retries so far in this process: allocations that found no
    free block, freed the cache and asked the driver again (each waits for the device); 0
    without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
