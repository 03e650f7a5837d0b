"""Where the GPU time of one MNIST MLP training step goes: the kernels of kasoku's step, per
configuration, from torch.profiler (CUPTI) over eagerly run steps after warm-up.

    python research/probes/mnist_kernels.py --config precision=tf32,optimizer_impl=fused \
        --config precision=tf32,optimizer_impl=fused,compile

Prints, per configuration, every kernel's count and GPU microseconds per step, and their sum:
the floor a whole-step CUDA graph can reach (a graph removes launch gaps, not kernel time).
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kasoku.commands.bench.rungs import rung_from_spec
from kasoku.commands.bench.pool import batch_spec, make_pool
from kasoku.commands.bench.runner import make_runner
from kasoku.workloads import create_workload


def kernel_table(config: str, batch_size: int, steps: int) -> None:
    wl = create_workload("mnist-mlp")
    torch.manual_seed(0)
    model = wl.build_model().cuda()
    device = torch.device("cuda")
    rung = rung_from_spec(config, "cuda")
    runner = make_runner(rung, wl, model, device, wl.recipe.lr, [])
    pool = make_pool(batch_spec(wl, model), batch_size, device, 4)
    runner(pool * 5)  # warm-up: compilation, cuBLAS handles, optimizer state
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner([pool[i % len(pool)] for i in range(steps)])
        torch.cuda.synchronize()
    totals, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    print(f"\n## {config}: {sum(counts.values()) / steps:.1f} kernels and "
          f"{sum(totals.values()) / steps:.1f} us of kernel time per step")
    for name, us in totals.most_common():
        print(f"{counts[name] / steps:5.1f} x {us / steps:7.2f} us  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", required=True)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    for config in args.config:
        kernel_table(config, args.batch_size, args.steps)


if __name__ == "__main__":
    main()
