"""What the always-on phase timers cost: the same built trainer stepped with the phase clock on
and off, alternating, in one process.

    python benchmarks/phase_overhead.py mnist-mlp --device cuda --loader device --synthetic
    python benchmarks/phase_overhead.py imagenet-resnet50 --device cuda --synthetic \
        --synthetic-size 512 --loader device --batch-size 256 --top-rung

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
from kasoku.bench.rungs import gpu_ladder
from kasoku.config import DataConfig, TrainConfig
from kasoku.perf.profile.phases import NoClock, PhaseClock
from kasoku.run import build_trainer, loaders_of
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
    args = p.parse_args()
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
        u.phases = clocks = clock(which)
        sync(device)
        t0 = time.perf_counter()
        before = u.samples
        for _ in range(args.steps):
            u.update()
        sync(device)  # note: the span's device work inside the timing
        rate = (u.samples - before) / (time.perf_counter() - t0)
        if which == "on":
            clocks.step()
            sync(device)
            phases.append(clocks.take())
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
        "workload": args.workload, "device": str(device), "batch_size": trainer.run_info["batch_size"], "loader": args.loader,
        "config": dataclasses.asdict(accel), "steps_per_round": args.steps,
        "sample_every": clock("on").sample_every,
        "sample_period_s": clock("on").sample_period_s,
        "rounds": args.rounds, "samples_per_s_off": off, "samples_per_s_on": on,
        "overhead_pct": 100 * (off - on) / off,
        "overhead_pct_paired": statistics.median(
            100 * (a - b) / a for a, b in zip(rates["off"], rates["on"])),
        "rates": rates, "phases": phases[-1], "torch": torch.__version__}))
    return 0


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
