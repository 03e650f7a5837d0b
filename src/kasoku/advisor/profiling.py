"""The profiled window judged where no command runs: ``ProfileWindow``, a trainer extension,
and ``profiling()``, a context manager for a loop of one's own. Each measures through
``kasoku.perf.profile.window.Window`` and judges the figures once (``verdict.judge``): a
``profile.json`` or ``figures`` that holds the figures and, under ``verdict``, the verdict."""
from __future__ import annotations

import contextlib
import json

import torch

from kasoku.accel.config import AccelConfig
from kasoku.advisor.verdict import judge
from kasoku.core.phases import PhaseClock
from kasoku.perf.profile.window import Window


def judged(window: Window, context: dict | None = None) -> dict:
    """The window's figures (``Window.analyse``) with the verdict under ``verdict``, judged
    with none of kasoku's levers known to be on (a loop of one's own is asked about all)."""
    figures = window.analyse(context)
    return {**figures.to_dict(), "verdict": judge(figures, AccelConfig()).to_dict()}


class ProfileWindow:
    """Trainer extension: profile iterations ``start + 1 .. start + warmup + steps`` and write
    ``trace.json`` and ``profile.json`` (figures, verdict) into ``trainer.out / folder``; the
    verdict line is printed. Call with ``trigger`` every iteration (its default)."""
    trigger = (1, "iteration")
    name = "ProfileWindow"

    def __init__(self, start: int = 10, steps: int = 10, warmup: int = 3,
                 folder: str = "profile"):
        self.start, self.steps, self.warmup, self.folder = start, steps, warmup, folder
        self.window: Window | None = None
        self.figures: dict | None = None
        self._clock = None

    def __call__(self, trainer) -> None:
        u = trainer.updater
        if self.window is None and self.figures is None and u.iteration >= self.start:
            self.window = Window(u.device, trainer.out / self.folder, self.steps, self.warmup)
            self._clock = u.phases
            u.phases = self.window.start(self._clock)
        elif self.window is not None and self.window.step():
            self._restore(u)
            self.figures = judged(self.window, {"batch_size": _batch_size(u)})
            self.window = None
            (trainer.out / self.folder / "profile.json").write_text(
                json.dumps(self.figures, indent=1, default=str))
            print(f"profile: {self.figures['verdict']['line']}", flush=True)

    def _restore(self, u) -> None:
        u.phases = self._clock

    def finalize(self, trainer) -> None:
        if self.window is not None:
            self.window.stop()
            self._restore(trainer.updater)
            self.window = None


def _batch_size(updater) -> int | None:
    return getattr(updater.loader, "batch_size", None)


class _Profiling:
    """What ``profiling()`` yields: ``iterate(loader)`` marks each batch's wait as the data
    phase; ``mark(phase)`` marks the step's phases (forward, backward, update, other);
    ``figures`` and ``verdict`` are set when the window ends."""

    def __init__(self, device, out, steps: int, warmup: int, skip: int):
        self.device = torch.device(device)
        self.window = Window(self.device, out, steps, warmup)
        self.skip = skip
        self.clock = None
        self.figures: dict | None = None
        self._plain = PhaseClock(self.device)

    def mark(self, phase: str) -> str | None:
        return self.clock.mark(phase) if self.clock is not None else None

    def iterate(self, loader):
        it = iter(loader)
        seen = 0
        while True:
            if seen == self.skip and self.window is not None and self.clock is None:
                self.clock = self.window.start(self._plain)
            elif self.clock is not None and self.window.step():
                self.clock = None
                self.figures = judged(self.window)
            self.mark("data")
            try:
                batch = next(it)
            except StopIteration:
                return
            self.mark("compute")
            seen += 1
            yield batch

    @property
    def verdict(self) -> str | None:
        return None if self.figures is None else self.figures["verdict"]["line"]


@contextlib.contextmanager
def profiling(device="cpu", out="profile", steps: int = 10, warmup: int = 3, skip: int = 5):
    """Profile a loop of your own::

        with profiling("cuda", out="runs/my-profile") as prof:
            for inputs, targets in prof.iterate(loader):
                prof.mark("forward");  loss = loss_fn(model(inputs.cuda()), targets.cuda())
                prof.mark("backward"); loss.backward()
                prof.mark("update");   opt.step(); opt.zero_grad()
        print(prof.verdict)

    Iterations ``skip + 1 ..`` (after compilation and warm-up) are profiled: ``warmup`` then
    ``steps``; ``mark`` is optional (unmarked, the step is one ``compute`` phase). The trace
    and ``prof.figures`` (with the verdict) are ready after the window or at the end of the
    ``with`` block."""
    p = _Profiling(device, out, steps, warmup, skip)
    try:
        yield p
    finally:
        if p.clock is not None:
            p.window.stop()
            if p.window.trace_path.exists():
                p.figures = judged(p.window)
