"""A profiled window of training steps: torch.profiler on for a few steps only, with kasoku's
phase marks written into the trace as host spans (``kasoku/forward``...), then the trace
analysed (``kasoku.perf.profile.trace``) and judged (``kasoku.perf.profile.verdict``).

Three ways in, one mechanism (``Window``):

- ``profile_updater(updater, ...)``: what ``kasoku profile`` runs on a built trainer;
- ``ProfileWindow``: a trainer extension that profiles steps ``start .. start + steps`` of a
  run and writes ``profile/`` into the run folder;
- ``profiling(device, ...)``: a context manager for a user's own loop
  (``for batch in prof.iterate(loader): ...``).

Before and after the window the profiler is not running: it is entered at the window's first
step and left at its last (zero cost outside; inside, its own cost is in the figures, so
``kasoku profile`` also reports the unprofiled throughput beside them).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from kasoku.core.phases import PhaseClock
from kasoku.perf import cpuinfo
from kasoku.perf.profile import trace as trace_mod
from kasoku.perf.profile.verdict import judge


class TracingClock:
    """Wraps a phase clock: each ``mark(phase)`` also closes the previous ``kasoku/PHASE`` host
    span of the trace and opens this one (``torch.profiler.record_function``). It returns the
    phase of the span it closed, whether or not the inner clock times this step, so that a
    mark that hands back (K-FAC's) reopens the span it interrupted."""

    def __init__(self, inner):
        self.inner = inner
        self.cuda = getattr(inner, "cuda", False)
        self._span = None
        self._phase: str | None = None

    def mark(self, phase: str) -> str | None:
        was = self._phase
        self.close()
        self._span = torch.profiler.record_function(trace_mod.PHASE_PREFIX + phase)
        self._span.__enter__()
        self._phase = phase
        self.inner.mark(phase)
        return was

    def close(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        self._phase = None

    def step(self) -> None:
        self.inner.step()

    def take(self) -> dict:
        return self.inner.take()

    def run_summary(self) -> dict:
        return self.inner.run_summary()

    @property
    def steps(self) -> int:
        return self.inner.steps


class Window:
    """torch.profiler over ``warmup + 1 + steps`` steps: ``start()`` before the first,
    ``step()`` after each (returns True after the last, when the trace has been written to
    ``out/trace.json``). The step after the warm-up is recorded as the analysis's anchor, so
    ``steps`` steps are analysed, as many as the settings say."""

    def __init__(self, device, out, steps: int = 10, warmup: int = 3):
        if steps < 1:
            raise ValueError(f"a profiled window needs at least 1 step, got {steps}")
        self.device = torch.device(device)
        self.out, self.steps, self.warmup = Path(out), steps, warmup
        self.clock: TracingClock | None = None
        self._prof = None
        self._done = 0
        self.trace_path = self.out / "trace.json"
        self.mem_peak_gib: float | None = None
        self.recompiles: int | None = None
        self._compiles_before = 0

    def start(self, clock) -> TracingClock:
        """Start profiling; returns the clock to mark phases with (wrapping ``clock``)."""
        from torch.profiler import ProfilerActivity, profile, schedule
        self.out.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._compiles_before = compiled_graphs()
        if cuda:
            # Kineto leaves CUPTI attached after the window unless told to tear it down, and
            # the steps after it run 10-20% slower (pytorch#144455; measured 12% on a script's
            # launch-bound MNIST step, docs/benchmarks.md). A value the user set is kept;
            # torch itself sets 0 where CUDA graphs need it (CUDA before 12.6).
            os.environ.setdefault("TEARDOWN_CUPTI", "1")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities,
                             schedule=schedule(wait=0, warmup=self.warmup,
                                               active=self.steps + 1, repeat=1),
                             on_trace_ready=lambda p: p.export_chrome_trace(
                                 str(self.trace_path)))
        with muted():
            self._prof.__enter__()
        self.clock = TracingClock(clock)
        return self.clock

    def step(self) -> bool:
        self._done += 1
        last = self._done == self.warmup + 1 + self.steps
        if last:
            self.clock.close()  # the last step's last phase ends here
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # note: sync, the window's device work in
        with muted():
            self._prof.step()
        if last:
            self.stop()
        return last

    def stop(self) -> None:
        if self._prof is None:
            return
        self.clock.close()
        prof, self._prof = self._prof, None
        with muted():
            prof.__exit__(None, None, None)
        if self.device.type == "cuda":
            self.mem_peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.recompiles = compiled_graphs() - self._compiles_before

    def analyse(self, context: dict | None = None, samples_per_step: int | None = None
                ) -> dict:
        """``analyse``'s figures of the trace, the context keys (see ``verdict.judge``), the
        window's peak memory and recompilations, and ``verdict``."""
        figures = trace_mod.analyse(trace_mod.load(self.trace_path), samples_per_step)
        figures.update(machine_facts(self.device))
        figures.update(context or {})
        figures.update(mem_peak_gib=self.mem_peak_gib, recompiles=self.recompiles,
                       profiled_steps=self.steps)
        figures["verdict"] = judge(figures).to_dict()
        return figures


def machine_facts(device) -> dict:
    """What the verdict reads of the machine, the same for ``kasoku profile``, ``kasoku
    bench`` and ``profiling()``: PyTorch's threads, on a GPU the card's memory (``card_gib``),
    and, on a CPU, its bf16 hardware
    (``kasoku.perf.cpuinfo``: ``cpu_bf16``, whether bf16 products run on bf16 units, and
    ``cpu_bf16_isa``, which)."""
    facts = {"threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":  # the card's size, beside the window's peak
        facts["card_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    if torch.device(device).type == "cpu":
        info = cpuinfo.cpu_info()
        facts.update(cpu_bf16=info.bf16_hardware, cpu_bf16_isa=info.bf16_isa)
    return facts


PROFILER_NOISE = re.compile(r"USDT|profiler_(start|stop)|Profiler clears events|"
                            r"ActivityProfilerController|CUPTI|kineto", re.IGNORECASE)
"""Lines the profiler's native code writes to the process's stderr, and its own warnings."""


@contextlib.contextmanager
def muted():
    """The profiler's own output kept off the terminal: its Python warnings ignored, and
    file descriptor 2 (where its C++ writes, past Python) pointed at a temporary file while
    it starts, steps and stops; lines that are not the profiler's are written back after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no file descriptor 2 to borrow
            yield
            return
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                for line in tmp.read().decode(errors="replace").splitlines():
                    if line.strip() and not PROFILER_NOISE.search(line):
                        print(line, file=sys.stderr)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process (0 when it never ran)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters.get("stats", {}).get("unique_graphs", 0))


def profile_updater(updater, out, steps: int = 10, warmup: int = 3,
                    context: dict | None = None, samples_per_step: int | None = None) -> dict:
    """Profile ``warmup + steps`` calls of ``updater.update()`` (a ``kasoku.train.Updater``,
    warm already) and return the analysed figures with the verdict; the trace is
    ``out/trace.json``."""
    window = Window(updater.device, out, steps, warmup)
    clock = updater.phases
    updater.phases = window.start(clock)
    try:
        last = False
        while not last:
            updater.update()
            last = window.step()
    finally:
        window.stop()
        updater.phases = clock
    return window.analyse(context, samples_per_step)


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
            self.figures = self.window.analyse({"batch_size": _batch_size(u)})
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
                self.figures = self.window.analyse()
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
                p.figures = p.window.analyse()
