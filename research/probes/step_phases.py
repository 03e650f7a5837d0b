"""ResNet-50's graph-replayed training step split along its critical path: the forward pass,
the backward pass stream by stream, and the optimizer update.

    python research/probes/step_phases.py BATCH_SIZE [RUNG] [--capture-priority P] [--side-priority P]

RUNG defaults to ``+wgrad-stream``. The rung is built, warmed up and timed as in
``step_profile.py``; then 10 more steps run under ``torch.profiler`` and each step is cut at
its optimizer kernels. A replayed CUDA graph runs its branches on streams of the driver's
choosing, so the phases are found from the kernels themselves:

- forward: from the end of the previous update to the first kernel on a second stream (with
  ``--wgrad-stream`` the first weight gradient; the loss and the first few backward kernels
  before it count here);
- backward: from there to the update, per stream: busy time, when its last kernel ended
  before the update, and its kernels by kind (``step_profile.group``);
- update: the optimizer's kernels.

Without a second stream in the backward pass, forward and backward are reported together.
``--capture-priority`` captures the graph on a stream of that priority (the main chain's
kernels keep it: PyTorch instantiates graphs with per-node priorities), ``--side-priority``
gives the weight-gradient stream one (lower numbers run first; CUDA clamps to its range).
"""
import argparse
import collections
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from kasoku.commands.bench.pool import cycle
from step_profile import group, prepare

STEPS = 10


def kernels(runner, pool) -> list[tuple[float, float, int, str]]:
    """(start us, end us, stream, name) of each kernel of ``STEPS`` profiled steps, by start."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner(cycle(pool, STEPS, 200))
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], e["args"].get("stream"), e["name"])
                  for e in events if e.get("cat") == "kernel")


def busy(ks, lo: float, hi: float) -> float:
    """Time in [lo, hi) covered by at least one of the kernels ``ks``."""
    total, end = 0.0, lo
    for s, e, _, _ in sorted(ks):
        s, e = max(s, lo), min(e, hi)
        if e > max(s, end):
            total += e - max(s, end)
            end = max(end, e)
    return total


def updates(ks) -> list[list[int]]:
    """Indices of the optimizer's kernels, grouped into one update per step."""
    groups: list[list[int]] = []
    for i, k in enumerate(ks):
        if group(k[3]) != "optimizer":
            continue
        if groups and k[0] - ks[groups[-1][-1]][1] < 300:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch_size", type=int)
    ap.add_argument("rung", nargs="?", default="+wgrad-stream")
    ap.add_argument("--capture-priority", type=int)
    ap.add_argument("--side-priority", type=int)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.capture_priority is not None:
        stream, graph = torch.cuda.Stream(dev, priority=args.capture_priority), torch.cuda.graph

        def graph_on_stream(cuda_graph, **kw):
            kw.setdefault("stream", stream)
            return graph(cuda_graph, **kw)
        torch.cuda.graph = graph_on_stream
    if args.side_priority is not None:
        from kasoku.accel import wgrad_stream
        wgrad_stream._side_streams[torch.cuda.current_device()] = torch.cuda.Stream(
            dev, priority=args.side_priority)
    print(f"stream priorities (lowest, highest): {torch.cuda.Stream.priority_range()}, capture "
          f"{args.capture_priority}, side {args.side_priority}")
    runner, pool = prepare(args.batch_size, args.rung)
    ks = kernels(runner, pool)
    steps = updates(ks)
    if len(steps) < 2:
        raise SystemExit(f"found {len(steps)} optimizer updates in {STEPS} steps; need 2 or more")
    rows, kinds = [], collections.defaultdict(float)
    for prev, cur in zip(steps, steps[1:]):
        t0, t_upd, t1 = ks[prev[-1]][1], ks[cur[0]][0], ks[cur[-1]][1]
        step = [k for k in ks if t0 <= k[0] < t1]
        first_stream = step[0][2]
        forked = [k for k in step if k[2] != first_stream]
        t_bwd = min(k[0] for k in forked) if forked else t_upd
        row = {"step": t1 - t0, "forward": t_bwd - t0, "backward": t_upd - t_bwd,
               "update": t1 - t_upd,
               "forward busy": busy([k for k in step if k[0] < t_bwd], t0, t_bwd)}
        for stream in sorted({k[2] for k in step}):
            mine = [k for k in step if k[2] == stream and t_bwd <= k[0] < t_upd]
            if mine:
                row[f"stream {stream} busy in backward"] = busy(mine, t_bwd, t_upd)
                row[f"stream {stream} ends before update"] = t_upd - max(k[1] for k in mine)
        rows.append(row)
        for s, e, stream, name in step:
            phase = ("update" if s >= t_upd else "forward" if s < t_bwd
                     else f"backward, stream {stream}")
            kinds[(phase, group(name))] += e - s
            kinds[(phase, group(name), "n")] += 1
    n = len(rows)
    keys = dict.fromkeys(k for r in rows for k in r)
    print("per step, us (mean of", n, "steps):")
    for k in keys:
        print(f"  {k:36s} {sum(r.get(k, 0.0) for r in rows) / n:8.1f}")
    print("kernels by phase and kind, us per step:")
    for key in sorted((k for k in kinds if len(k) == 2), key=lambda k: (k[0], -kinds[k])):
        count = kinds[(*key, "n")] / n
        print(f"  {key[0]:22s} {key[1]:22s} {kinds[key] / n:8.1f} {count:5.0f} launches")


if __name__ == "__main__":
    main()
