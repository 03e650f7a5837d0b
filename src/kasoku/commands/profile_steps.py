"""The unprofiled steps of ``kasoku profile`` (and of each side of its A/B runs): a warm-up
that lasts until the step time settles, then timed windows.

The warm-up runs ``--skip`` steps, then blocks of as many until two agree per step within
``WARM_AGREE`` and the last compiled nothing (at most ``WARM_MAX_S``): compilation, autotuning
and a compiled step's first recompilations stay out of the timed steps. The timed steps last
``--measure-seconds`` at least, in ``MEASURE_WINDOWS`` windows each ended by a synchronize, so
one process has a spread; K-FAC's steps run in whole cycles of its schedule, as one span. All
workers of a data-parallel run take worker 0's decisions, or their collectives would hang.
"""
from __future__ import annotations

import time

import torch

from kasoku.distributed import ddp
from kasoku.perf.noise import MachineWatch, Stability, job_pids, spread
from kasoku.perf.profile.kfac_cost import cycle_steps, every_step_clock, measured_steps
from kasoku.perf.profile.window import compiled_graphs

MEASURE_WINDOWS = 5
"""The unprofiled steps are timed in this many windows (one span with K-FAC)."""
MAX_MEASURE_STEPS = 2000
WARM_AGREE = 0.10
WARM_MAX_S = 120.0


def warm_up(u, cfg) -> tuple[float, int, float]:
    """``cfg.skip`` steps, then blocks of as many (2 at least) until two blocks agree per step
    within ``WARM_AGREE`` and the last compiled nothing, for at most ``WARM_MAX_S``:
    compilation, autotuning and a compiled step's first recompilations stay out of the timed
    steps. All workers of a data-parallel run follow worker 0's decision. Returns (seconds,
    steps, seconds per step of the last block)."""
    device = u.device
    t0 = time.perf_counter()
    for _ in range(cfg.skip):
        u.update()
    sync(device)
    cycle = cycle_steps(u.optimizer)  # K-FAC's: blocks of whole cycles, alike
    steps, block, last = cfg.skip, -(-max(2, cfg.skip) // cycle) * cycle, None
    while True:
        graphs, t1 = compiled_graphs(), time.perf_counter()
        for _ in range(block):
            u.update()
        sync(device)
        per = (time.perf_counter() - t1) / block
        steps += block
        settled = (last is not None and abs(per / last - 1) <= WARM_AGREE
                   and compiled_graphs() == graphs)
        done = settled or time.perf_counter() - t0 > WARM_MAX_S
        if ddp.active():
            done = ddp.broadcast_object(done)
        if done:
            return time.perf_counter() - t0, steps, per
        last = per


def time_steps(u, cfg) -> dict:
    """Warm ``u`` (a ``kasoku.train.Updater``) up (``warm_up``), then time its steps
    unprofiled, in windows: the throughput, each window's rate and its stability, the
    phases, and the graphs compiled while timed (none, or the figure is not the lever's)."""
    device = u.device
    skip_s, skipped, step_s = warm_up(u, cfg)
    u.phases.take()
    cycle = cycle_steps(u.optimizer)
    wanted = cfg.measure_steps
    if cycle == 1 and step_s > 0:  # K-FAC's steps: whole cycles of them, as asked
        wanted = max(wanted, min(MAX_MEASURE_STEPS, int(cfg.measure_seconds / step_s)))
    if ddp.active():  # every worker steps as often as worker 0, or the collectives hang
        wanted = ddp.broadcast_object(wanted)
    steps = measured_steps(wanted, cycle)
    clock = u.phases
    if cycle > 1:  # steps unalike on a schedule (K-FAC's): each timed, none left to chance
        u.phases = every_step_clock(device)
    else:  # steps alike: the clock's sample, but never none in a short window
        clock.time_next()
    # Steps alike: a few windows, each timed to a synchronize, so a single process has a
    # spread too (the A/B runs' noise rule reads it); K-FAC's cycles stay one span.
    windows = 1 if cycle > 1 else min(MEASURE_WINDOWS, steps)
    counts = [steps // windows + (i < steps % windows) for i in range(windows)]
    window_rates, elapsed = [], 0.0
    graphs = compiled_graphs()
    watch = MachineWatch(own=job_pids(), device=device).start()
    try:
        samples0 = u.samples
        for i, n in enumerate(counts):
            before, t0 = u.samples, time.perf_counter()
            for _ in range(n):
                u.update()
            if i == len(counts) - 1:
                u.phases.step()  # the last step's phases end here, with its work
            sync(device)  # note: sync, the window's device work inside its span
            seconds = time.perf_counter() - t0
            elapsed += seconds
            window_rates.append((u.samples - before) / seconds)
        phases = u.phases.take()
    finally:
        u.phases = clock
    samples = u.samples - samples0
    return {"skip_s": skip_s, "skipped_steps": skipped, "measure_s": elapsed,
            "measured_steps": steps, "recompiles": compiled_graphs() - graphs,
            "cycle_steps": cycle, "samples_per_s": samples / elapsed,
            "window_rates": window_rates,
            "stability": Stability(spread(window_rates), watch.stop()).to_dict(),
            "samples_per_step": samples // max(1, steps),
            "phases": phases, "phases_split": u.phases_split}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
