"""A profiled window of training steps: torch.profiler on for a few steps only, with kasoku's
phase marks written into the trace as host spans (``kasoku/forward``...), then the trace
analysed (``kasoku.perf.profile.trace``). The window measures; the advisor
(``kasoku.advisor``) judges what it measured.

Three ways in, one mechanism (``Window``):

- ``profile_updater(updater, ...)``: what ``kasoku profile`` runs on a built trainer;
- ``kasoku.advisor.profiling.ProfileWindow``: a trainer extension that profiles steps
  ``start .. start + steps`` of a run and writes ``profile/`` into the run folder;
- ``kasoku.advisor.profiling.profiling(device, ...)``: a context manager for a user's own loop
  (``for batch in prof.iterate(loader): ...``).

Before and after the window the profiler is not running: it is entered at the window's first
step and left at its last (zero cost outside; inside, its own cost is in the figures, so
``kasoku profile`` also reports the unprofiled throughput beside them).
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from kasoku.perf import cpuinfo
from kasoku.perf.profile import roofline as roofline_mod
from kasoku.perf.profile import trace as trace_mod
from kasoku.perf.profile import work as work_mod
from kasoku.perf.profile.figures import StepFigures

TRACE_CAP_BYTES = 300_000_000
"""The largest window trace analysed. Parsing holds the whole JSON and then its events as
Python objects: a 2.17 GB trace (LBFGS, 10 steps, each running its closure 20 times) grew
the analysis to 14.6 GB, 6.7 times the file, silent for minutes. At 300 MB that is about
2 GB, which a laptop has to spare; a window of ordinary steps records far less (a width-1024
MLP's 4 steps on a CPU, with the operators' shapes: 0.27 MB)."""


def trace_bytes(path) -> int | None:
    """The size of the trace at ``path`` where it exceeds ``TRACE_CAP_BYTES`` (too large to
    analyse), else None."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        return None
    return size if size > TRACE_CAP_BYTES else None


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
    ``steps`` steps are analysed, as many as the settings say.

    ``work_step`` (on a GPU): one step more, after the window, profiled apart with the
    operators' shapes (``out/work_trace.json``): the work each kernel class does
    (``kasoku.perf.profile.work``), which ``analyse`` judges against the machine's measured
    limits (``roofline``). Its own profiler, so that recording shapes costs the window's
    steps nothing; ``eager`` (a context manager's factory) runs it eagerly where the step
    replays a CUDA graph, whose replays launch no operators. No work step follows a window
    whose trace is over ``TRACE_CAP_BYTES``: it would not be analysed.

    ``cpu_shapes`` (on a CPU): the window's own steps recorded with the operators' shapes, and
    ``analyse`` adds ``product_flops``, the FLOPs per step of the analysed steps' matrix
    products and convolutions per dtype (``work.product_flops``). There the operators are
    the work, so no second session is needed, and one would do harm: a work step's session
    on a CPU, started in the step where the window's ended, made a later garbage collection
    crash the process (torch 2.13, within a few profiles in one process)."""

    def __init__(self, device, out, steps: int = 10, warmup: int = 3, work_step: bool = False,
                 eager=None, cpu_shapes: bool = False):
        if steps < 1:
            raise ValueError(f"a profiled window needs at least 1 step, got {steps}")
        self.device = torch.device(device)
        self.out, self.steps, self.warmup = Path(out), steps, warmup
        self.clock: TracingClock | None = None
        self._prof = None
        self._done = 0
        self.trace_path = self.out / "trace.json"
        self.work_step = work_step and self.device.type == "cuda"
        self.cpu_shapes = cpu_shapes and self.device.type == "cpu"
        self.work_path = self.out / "work_trace.json"
        self._eager = eager
        self._work = None
        self._work_ctx = None
        self._teardown = False
        self.mem_peak_gib: float | None = None
        self.recompiles: int | None = None
        self._compiles_before = 0

    def start(self, clock) -> TracingClock:
        """Start profiling; returns the clock to mark phases with (wrapping ``clock``)."""
        from torch.profiler import ProfilerActivity, profile, schedule
        self.out.mkdir(parents=True, exist_ok=True)
        self.work_path.unlink(missing_ok=True)  # an earlier run's, in a folder used again
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._compiles_before = compiled_graphs()
        if cuda:
            # Kineto leaves CUPTI attached after the window unless told to tear it down, and
            # the steps after it run 10-20% slower (pytorch#144455; measured 12% on a script's
            # launch-bound MNIST step, docs/benchmarks.md). A value the user set is kept;
            # torch itself sets 0 where CUDA graphs need it (CUDA before 12.6). Kineto reads
            # it when a session stops, and the next session after a teardown may record no
            # GPU activity (seen: a script's work step): with a work step to come, CUPTI is
            # torn down after it, not after the window.
            self._teardown = "TEARDOWN_CUPTI" not in os.environ
            if self._teardown:
                os.environ["TEARDOWN_CUPTI"] = "0" if self.work_step else "1"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities, record_shapes=self.cpu_shapes,
                             schedule=schedule(wait=0, warmup=self.warmup,
                                               active=self.steps + 1, repeat=1),
                             on_trace_ready=lambda p: p.export_chrome_trace(
                                 str(self.trace_path)))
        with muted():
            self._prof.__enter__()
        self.clock = TracingClock(clock)
        return self.clock

    @property
    def total_steps(self) -> int:
        """The steps ``step()`` is called for, the work step included."""
        return self.warmup + 1 + self.steps + (1 if self.work_step else 0)

    def step(self) -> bool:
        self._done += 1
        if self._work is not None:  # the work step ran
            self._stop_work()
            return True
        last = self._done == self.warmup + 1 + self.steps
        if last:
            self.clock.close()  # the last step's last phase ends here
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # note: sync, the window's device work in
        with muted():
            self._prof.step()
        if last:
            self.stop()
            if self.work_step and trace_bytes(self.trace_path) is None:
                self._start_work()
                return False
        return last

    def _start_work(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._work = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             record_shapes=True)
        self._work_ctx = self._eager() if self._eager is not None else contextlib.nullcontext()
        self._work_ctx.__enter__()
        with muted():
            self._work.__enter__()

    def _stop_work(self) -> None:
        prof, self._work = self._work, None
        torch.cuda.synchronize(self.device)  # note: sync, the work step's kernels in its trace
        if self._teardown and "DISABLE_CUPTI_LAZY_REINIT" not in os.environ:
            os.environ["TEARDOWN_CUPTI"] = "1"  # torch's CUDA graphs set both, to keep it
        try:
            with muted():
                prof.__exit__(None, None, None)
                prof.export_chrome_trace(str(self.work_path))
        finally:
            ctx, self._work_ctx = self._work_ctx, None
            ctx.__exit__(None, None, None)
        del prof
        gc.collect()  # the session's garbage now (see stop)

    def stop(self) -> None:
        if self._work is not None:  # stopped during the work step: its trace is not kept
            prof, self._work = self._work, None
            with muted():
                prof.__exit__(None, None, None)
            ctx, self._work_ctx = self._work_ctx, None
            ctx.__exit__(None, None, None)
        if self._prof is None:
            return
        self.clock.close()
        prof, self._prof = self._prof, None
        with muted():
            prof.__exit__(None, None, None)
        # The ended session's garbage collected now, before any other session starts: a
        # collection that met it later, with the work step's session begun in the same step,
        # crashed the process (a segmentation fault in the garbage collector; torch 2.11 on an
        # H200, torch 2.13 on a CPU).
        del prof
        gc.collect()
        if self.device.type == "cuda":
            self.mem_peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.recompiles = compiled_graphs() - self._compiles_before

    def analyse(self, context: dict | None = None, samples_per_step: int | None = None
                ) -> StepFigures:
        """The window's figures, filled here: ``analyse``'s of the trace, the machine's
        facts, ``context`` (what the caller knows of the run: ``StepFigures``' fields, and
        figures kept as they are, such as the run's ``config`` as saved), the window's peak
        memory and recompilations."""
        events = trace_mod.read_events(self.trace_path)
        trace = trace_mod.parse(events)
        figures = trace_mod.analyse(trace, samples_per_step)
        if self.cpu_shapes:
            steps = trace_mod.steps_of(trace)
            figures["product_flops"] = work_mod.product_flops(
                events, figures["steps"], (steps.starts[1], steps.end))
        figures.update(machine_facts(self.device))
        figures.update(context or {})
        figures.update(mem_peak_gib=self.mem_peak_gib, recompiles=self.recompiles,
                       profiled_steps=self.steps)
        if self.work_path.exists() and figures.get("by_class_ms"):
            figures.update(self._roofline(figures))
        return StepFigures.from_dict(figures)

    def _roofline(self, figures: dict) -> dict:
        """``roofline``: each kernel class's distance to its measured limit, from the work
        step's trace (``roofline_note`` instead where it cannot be read)."""
        try:
            work = work_mod.class_work(trace_mod.read_events(self.work_path))
            dtypes = {dt for w in work.values() for dt in (w.flop_by_dtype or {})} or {"bf16"}
            roofs = roofline_mod.measure_roofs(self.device, dtypes,
                                               torch.backends.cuda.matmul.allow_tf32)
            return {"roofline": roofline_mod.roofline(
                figures["by_class_ms"], work, roofs, figures.get("optimizer_bytes"),
                figures.get("device_ms"))}
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return {"roofline_note": f"not measured: {exc}"}


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
                    context: dict | None = None, samples_per_step: int | None = None,
                    work_step: bool = False, eager=None) -> StepFigures:
    """Profile ``warmup + steps`` calls of ``updater.update()`` (a ``kasoku.train.Updater``,
    warm already) and return the analysed figures (the caller judges them); the trace is
    ``out/trace.json``; ``work_step``, ``eager``: ``Window``'s."""
    window = Window(updater.device, out, steps, warmup, work_step, eager)
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
