"""What the always-on phase timers cost: the same built trainer stepped with the phase clock on
and off, alternating, in one process.

    python benchmarks/phase_overhead.py mnist-mlp --device cuda --loader device --synthetic
    python benchmarks/phase_overhead.py imagenet-resnet50 --device cuda --synthetic \
        --synthetic-size 512 --loader device --batch-size 256 --top-rung

``--clock-cost`` measures the clock alone instead: the host time its calls for one step (a
step's six marks and its end) take, with no training step between them, timed steps and
untimed ones together over many steps, minus the same calls on a clock that times nothing.
That is what the timers add to each step, free of the run-to-run noise of a throughput A/B:

    python benchmarks/phase_overhead.py mnist-mlp --device cuda --clock-cost

Each round times ``--steps`` steps with the clock off, then on (CUDA: events and one
synchronize around the span; CPU: perf_counter); warm-up (compilation, graph capture) first and
excluded. Prints one JSON line: throughput medians over ``--rounds`` rounds, off and on, the
overhead in % of those medians and the median of each round's own (paired) overhead
(positive: the timers cost that much).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from kasoku.accel.config import AccelConfig
from kasoku.commands.bench.rungs import gpu_ladder
from kasoku.commands.train import build_trainer, loaders_of
from kasoku.core.phases import NoClock, PhaseClock
from kasoku.data.config import DataConfig
from kasoku.train.config import TrainConfig
from kasoku.workloads import create_workload


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--loader", default="serial")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--synthetic-size", type=int)
    p.add_argument("--data")
    p.add_argument("--top-rung", action="store_true", help="the GPU ladder's last rung")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--sample-every", type=int, help="time one step in N (default: the clock's)")
    p.add_argument("--sample-period", type=float,
                   help="time at most one step per this many seconds (default: the clock's)")
    p.add_argument("--clock-cost", action="store_true",
                   help="time the clock's own calls per step, without training")
    args = p.parse_args()
    if args.clock_cost:
        return clock_cost(torch.device(args.device), args.sample_every, args.sample_period)
    accel = gpu_ladder()[-1].config if args.top_rung else AccelConfig()
    wl = create_workload(args.workload)
    data = DataConfig(root=args.data, synthetic=args.synthetic,
                      synthetic_train_size=args.synthetic_size)
    train = TrainConfig(batch_size=args.batch_size, device=args.device, loader=args.loader,
                        progress=False, overwrite=True, out="/tmp/kasoku-phase-overhead")
    trainer = build_trainer(wl, data, train, accel)
    u, device = trainer.updater, trainer.updater.device
    def clock(which: str):
        return NoClock() if which == "off" else PhaseClock(
            device, sample_every=args.sample_every, sample_period_s=args.sample_period)

    phases = []  # each "on" span's phases: a fresh clock per span, so no span's step
    # includes the time of the "off" span before it

    def span(which: str) -> float:
        u.phases = timer = clock(which)
        sync(device)
        t0 = time.perf_counter()
        before = u.samples
        for _ in range(args.steps):
            u.update()
        sync(device)  # note: the span's device work inside the timing
        rate = (u.samples - before) / (time.perf_counter() - t0)
        if which == "on":
            timer.step()
            sync(device)
            phases.append(timer.take())
        return rate

    for which in ("off", "on"):  # compilation, capture, autotuning: excluded
        u.phases = clock(which)
        for _ in range(args.warmup):
            u.update()
    rates = {"off": [], "on": []}
    for r in range(args.rounds):  # off-on, then on-off: no side always goes first
        for which in (("off", "on") if r % 2 == 0 else ("on", "off")):
            rates[which].append(span(which))
    for loader in loaders_of(trainer):
        getattr(loader, "close", lambda: None)()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(json.dumps({
        "workload": args.workload, "device": str(device),
        "batch_size": trainer.run_info["batch_size"], "loader": args.loader,
        "config": dataclasses.asdict(accel), "steps_per_round": args.steps,
        "sample_every": clock("on").sample_every,
        "sample_period_s": clock("on").sample_period_s,
        "rounds": args.rounds, "samples_per_s_off": off, "samples_per_s_on": on,
        "overhead_pct": 100 * (off - on) / off,
        "overhead_pct_paired": statistics.median(
            100 * (a - b) / a for a, b in zip(rates["off"], rates["on"])),
        "rates": rates, "phases": phases[-1], "torch": torch.__version__}))
    return 0


def clock_cost(device, sample_every, sample_period, steps: int = 100_000) -> int:
    """Print the host microseconds per step the clock's calls cost (medians of 5 runs): on an
    untimed step, on a timed one, and what that makes per step and in % for steps of a few
    lengths, given one timed step in max(sample_every, sample_period / step time)."""
    marks = ("data", "h2d", "forward", "backward", "update", "other")

    def per_step(make) -> float:
        runs = []
        for _ in range(5):
            clock = make()
            t0 = time.perf_counter()
            for _ in range(steps):
                clock.step()
                for m in marks:
                    clock.mark(m)
                if clock.steps > 1000:
                    clock.take()
            sync(device)
            runs.append(1e6 * (time.perf_counter() - t0) / steps)
        return statistics.median(runs)

    default = PhaseClock(device, sample_every=sample_every, sample_period_s=sample_period)
    off = per_step(NoClock)
    untimed = per_step(lambda: PhaseClock(device, sample_every=10**9)) - off
    timed = per_step(lambda: PhaseClock(device, sample_every=1, sample_period_s=0.0)) - off
    if device.type != "cuda":  # every step is timed on a CPU
        untimed = timed
    by_step = {}
    for ms in (0.1, 0.2, 1.3, 8.0, 33.0):
        every = (max(default.sample_every, default.sample_period_s / (1e-3 * ms))
                 if device.type == "cuda" else 1)
        us = untimed + (timed - untimed) / every
        by_step[f"{ms} ms"] = {"timed_1_in": round(every, 1), "clock_us": us,
                               "overhead_pct": 100 * us / (1e3 * ms)}
    print(json.dumps({"device": str(device), "sample_every": default.sample_every,
                      "sample_period_s": default.sample_period_s, "off_us": off,
                      "untimed_step_us": untimed, "timed_step_us": timed,
                      "by_step_time": by_step, "torch": torch.__version__}))
    return 0


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
