"""Where a `kasoku train` run's time goes, phase by phase: runs the command given after `--`
with the whole-step graph's warm-up and capture, each trainer update and each evaluation
timed (a device synchronize before and after each, so the figures are the phases' own; the
total is a little slower than an untimed run). Prints the first updates one by one, then a
summary.

    python benchmarks/train_time_breakdown.py -- mnist-mlp --device cuda --data .data/mnist \
        --loader device --cuda-graph --precision tf32 --optimizer-impl compiled \
        --steps-per-call 50 --epochs 20 --no-progress
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch

from kasoku.accel.graph import CudaGraphStep
from kasoku.cli import main
from kasoku.train.extensions.evaluator import Evaluator
from kasoku.train.step import Updater

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(cls, name: str, label: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        TIMES[label].append(time.perf_counter() - t0)
        return out

    setattr(cls, name, wrapper)


def run() -> None:
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    timed(CudaGraphStep, "_warm_up", "graph warm-up call")
    timed(CudaGraphStep, "_capture", "graph capture (+1 replay)")
    timed(Updater, "update", "trainer update")
    timed(Evaluator, "evaluate", "evaluation")
    t0 = time.perf_counter()
    main(["train", *argv])
    wall = time.perf_counter() - t0
    updates = TIMES["trainer update"]
    print("\nfirst updates (s):", " ".join(f"{t:.4f}" for t in updates[:8]))
    for label, times in TIMES.items():
        print(f"{label:28s} n={len(times):5d}  total {sum(times):7.3f} s  first {times[0]:.4f} s"
              f"  median {statistics.median(times):.5f} s")
    print(f"main() wall {wall:.2f} s")


if __name__ == "__main__":
    run()
