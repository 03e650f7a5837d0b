"""ResNet-50's training step on one GPU, kernel by kernel: rate, then the profiled step's span,
busy and idle time, launches, and the time per kind of kernel (kasoku's batch-norm and pool
kernels by name, the rest as ``kasoku.perf.profile.kernels.classify`` sorts them) and the longest
kernels.

    python research/probes/step_profile.py BATCH_SIZE [RUNG]     # RUNG: default +fast-stem

Built, accelerated and warmed up as ``kasoku bench`` does; rate: median of 5 CUDA-event-timed
windows of 20 steps; profile: 10 more steps under torch.profiler (device times of kernels).
Idle time: the span not covered by any kernel (launch gaps inside the graph replay); kernel
time summed over busy time: how much kernels overlapped (streams side by side).
"""
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kasoku.commands.bench.pool import batch_spec, cycle, make_pool
from kasoku.commands.bench.rungs import rung_from_spec
from kasoku.commands.bench.timing import measure_windows, timed
from kasoku.commands.bench.runner import make_runner
from kasoku.perf.profile.kernels import breakdown, classify
from kasoku.workloads import create_workload

BN_KERNELS = ("bn_stats", "bn_forward", "bn_backward_reduce", "bn_backward_kernel",
              "bn_running", "max_pool")


def group(name: str) -> str:
    """kasoku's own kernels by name, the rest by ``kasoku.perf.profile.kernels.classify``."""
    return next((k for k in BN_KERNELS if k in name), None) or classify(name)


def prepare(bs: int, cfg: str):
    """The rung built, accelerated and warmed up as ``kasoku bench`` does; prints its rate (median
    of 5 CUDA-event-timed windows of 20 steps) and returns ``(runner, pool)``."""
    dev = torch.device("cuda")
    rung = rung_from_spec(cfg, "cuda")
    wl = create_workload("imagenet-resnet50")
    torch.manual_seed(0)
    model = wl.build_model().to(dev)
    pool = make_pool(batch_spec(wl, model), bs, dev, 4, seed=0)
    notes = []
    runner = make_runner(rung, wl, model, dev, wl.recipe.lr, notes)
    _, first = timed(dev, lambda: runner(cycle(pool, 1, 0)))
    timed(dev, lambda: runner(cycle(pool, 10, 1)))
    m, _ = measure_windows(runner, pool, dev, bs, 20, 5, start=11)
    print(json.dumps({"batch_size": bs, "config": rung.label,
                      "samples_per_s": round(m.figures()["samples_per_s"]["median"]),
                      "windows": sorted(round(r) for r in m.samples_per_s),
                      "first_step_s": round(first, 1), "notes": notes}))
    return runner, pool


def main():
    bs = int(sys.argv[1])
    cfg = sys.argv[2] if len(sys.argv) > 2 else "+fast-stem"
    runner, pool = prepare(bs, cfg)
    n = 10
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner(cycle(pool, n, 200))
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, idle, end = 0.0, 0.0, spans[0][0]
    for s, e, _ in spans:
        idle += max(0.0, s - end)
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    summed = sum(e - s for s, e, _ in spans)
    print(f"per step: span {(end - spans[0][0]) / n:.1f} us, kernels busy {busy / n:.1f} us, "
          f"idle {idle / n:.1f} us, {len(spans) / n:.0f} launches, kernel time summed "
          f"{summed / n:.1f} us (more than busy where kernels ran side by side)")
    # Per kernel name (times in us here): kasoku.perf.profile.kernels' own totals, longest first.
    per_name = breakdown(((name, e - s) for s, e, name in spans), n, 0.0, "cuda").kernels
    by_group, launches = collections.defaultdict(float), collections.Counter()
    for name, total, count in per_name:
        by_group[group(name)] += total
        launches[group(name)] += count
    for g in sorted(by_group, key=lambda k: -by_group[k]):
        print(f"{g:40s} {by_group[g] / n:9.1f} us/step {launches[g] / n:5.0f} launches, "
              f"{by_group[g] / launches[g]:6.2f} us each")
    print("--- longest kernels")
    for name, total, count in per_name[:25]:
        print(f"{total / n:9.1f} us/step {count / n:5.0f}x  {name[:100]}")


if __name__ == "__main__":
    main()
