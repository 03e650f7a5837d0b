"""Where float8 training pays, by the width of the matrices (issue: a transformer workload;
float8 was 0.92x the bf16 rung on GPT-2 small, 768 wide). A transformer's MLP (Linear d->4d,
GELU, Linear 4d->d, no bias) on 16 x 1024 tokens, forward and backward, compiled, in bf16 and
under torchao's float8 training (tensorwise and rowwise scaling), for several widths d:

    python benchmarks/float8_shapes.py [--widths 768,1024,1280,1600,2048,4096,8192]

Prints ms per step (the median of 5 windows of 10 steps, CUDA events, after 5 warm-up steps
that include the compilation) and float8's speed-up over bf16 at each width."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def mlp(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(approximate="tanh"),
                         nn.Linear(4 * d, d, bias=False))


def step_ms(model: nn.Module, x: torch.Tensor, windows: int = 5, steps: int = 10) -> float:
    def run(n):
        for _ in range(n):
            model(x).float().square().mean().backward()
            x.grad = None  # the input's gradient is computed, as a layer's is, not summed
    run(5)
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(steps)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="768,1024,1280,1600,2048,4096,8192")
    p.add_argument("--tokens", type=int, default=16 * 1024)
    args = p.parse_args()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch._dynamo.config.cache_size_limit = 64
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens")
    print(f"{'d':>6s} {'bf16 ms':>8s} {'tensorwise':>11s} {'rowwise':>9s}  (float8: ms, x bf16)")
    for d in (int(w) for w in args.widths.split(",")):
        x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ms = {}
        t0 = time.perf_counter()
        for name in ("bf16", "tensorwise", "rowwise"):
            torch.manual_seed(0)
            model = mlp(d).cuda().to(torch.bfloat16)
            if name != "bf16":
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(name))
            ms[name] = step_ms(torch.compile(model), x)
            del model
            torch._dynamo.reset()
        f8 = "  ".join(f"{ms[n]:6.2f} {ms['bf16'] / ms[n]:4.2f}x"
                       for n in ("tensorwise", "rowwise"))
        print(f"{d:6d} {ms['bf16']:8.2f}   {f8}   ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
