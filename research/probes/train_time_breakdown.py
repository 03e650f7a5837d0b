"""Where a `kasoku train` run's time goes, phase by phase: runs the command given after `--`
with the whole-step graph's warm-up and capture, each trainer update and each evaluation
timed (a device synchronize before and after each, so the figures are the phases' own; the
total is a little slower than an untimed run). Prints the first updates one by one, then a
summary.

    python research/probes/train_time_breakdown.py -- mnist-mlp --device cuda --data .data/mnist \
        --loader device --cuda-graph --precision tf32 --optimizer-impl compiled \
        --steps-per-call 50 --epochs 20 --no-progress
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

from kasoku.accel.graph import CudaGraphStep
from kasoku.cli import main
from kasoku.train import extensions
from kasoku.train.extensions.evaluator import Evaluator
from kasoku.train import step as step_module
from kasoku.train.step import Updater

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(cls, name: str, label: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():  # recording a graph: nothing runs
            return inner(*args, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        TIMES[label].append(time.perf_counter() - t0)
        return out

    setattr(cls, name, wrapper)


def profiled(cls, name: str) -> None:
    """Run the first call of ``cls.name`` under cProfile and print its top functions."""
    inner = getattr(cls, name)
    calls = []

    def wrapper(*args, **kwargs):
        if calls:
            return inner(*args, **kwargs)
        calls.append(1)
        profiler = cProfile.Profile()
        out = profiler.runcall(inner, *args, **kwargs)
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            print(f"\n{name}, first call: top functions by {key}")
            pstats.Stats(profiler).sort_stats(key).print_stats(18)
        return out

    setattr(cls, name, wrapper)


def gpu_gaps(argv: list[str]) -> None:
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
    inner = Updater.update

    def update(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(self)
        end.record()
        marks.append((start, end, self.is_new_epoch))
        return out

    Updater.update = update
    t0 = time.perf_counter()
    main(["train", *argv])
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    busy = [s.elapsed_time(e) / 1e3 for s, e, _ in marks]
    gaps = [(e.elapsed_time(s2) / 1e3, new_epoch)
            for (_, e, new_epoch), (s2, _, _) in zip(marks, marks[1:])]
    at_epoch_end = [g for g, new_epoch in gaps if new_epoch]
    inside = [g for g, new_epoch in gaps if not new_epoch]
    print(f"\nGPU from the first update's start to the last one's end: "
          f"{marks[0][0].elapsed_time(marks[-1][1]) / 1e3:.3f} s")
    print(f"  in updates (first two: {busy[0]:.3f} s, {busy[1]:.3f} s)  total {sum(busy):.3f} s"
          f"  median {statistics.median(busy) * 1e3:.2f} ms")
    print(f"  idle between updates inside epochs: {sum(inside):.3f} s over {len(inside)} gaps"
          f" (median {statistics.median(inside) * 1e6:.0f} us)")
    print(f"  idle at epoch ends (extensions): {sum(at_epoch_end):.3f} s over "
          f"{len(at_epoch_end)} (median {statistics.median(at_epoch_end) * 1e3:.2f} ms)")
    print(f"main() wall {wall:.2f} s")


def run() -> None:
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    own = sys.argv[:sys.argv.index("--") if "--" in sys.argv else None]
    if "--gpu-gaps" in own:
        return gpu_gaps(argv)
    if "--profile-warm-up" in own:
        profiled(CudaGraphStep, "_warm_up")
    # The optimizer steps inside a call (several per call with --steps-per-call): the module
    # global the step functions call, so wrapping it times each one.
    for fn in ("train_step", "loss_only_step"):
        timed(step_module, fn, "optimizer step (eager)")
    timed(CudaGraphStep, "_warm_up", "graph warm-up call")
    timed(CudaGraphStep, "_capture", "graph capture (+1 replay)")
    timed(Updater, "update", "trainer update")
    timed(Evaluator, "evaluate", "evaluation")
    # Every extension call (the evaluator's includes its evaluation and its reporting).
    for name in dir(extensions):
        cls = getattr(extensions, name)
        if isinstance(cls, type) and "__call__" in vars(cls):
            timed(cls, "__call__", f"extension {name}")
    t0 = time.perf_counter()
    main(["train", *argv])
    wall = time.perf_counter() - t0
    updates = TIMES["trainer update"]
    print("\nfirst updates (s):", " ".join(f"{t:.4f}" for t in updates[:8]))
    steps = TIMES["optimizer step (eager)"]
    print("first optimizer steps (s):", " ".join(f"{t:.4f}" for t in steps[:8]))
    for label, times in TIMES.items():
        print(f"{label:28s} n={len(times):5d}  total {sum(times):7.3f} s  first {times[0]:.4f} s"
              f"  median {statistics.median(times):.5f} s")
    print(f"main() wall {wall:.2f} s")


if __name__ == "__main__":
    run()
