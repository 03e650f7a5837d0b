"""The cross-entropy over GPT-2's head on one GPU, forward and backward: PyTorch's eager
kernels (the logits cast to fp32, as autocast does), inductor's (compiled, the cast fused), and
``kasoku.accel.cross_entropy``'s kernels at several block sizes and warps. The loss and the
gradient of each beside eager's, and the time of each (CUDA events, the median of runs after a
warm-up), with the bytes the kernels need (logits read twice, gradient written once) over
that time.

    PYTHONPATH=src python research/probes/ce_kernel.py [--rows 16384] [--vocab 50304]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from kasoku.accel import cross_entropy as ce


def timed(fn, reps: int = 20, runs: int = 7) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=50304)
    args = p.parse_args()
    torch.manual_seed(0)
    x = (2 * torch.randn(args.rows, args.vocab, device="cuda")).bfloat16().requires_grad_()
    t = torch.randint(args.vocab, (args.rows,), device="cuda")

    def eager():
        return F.cross_entropy(x.float(), t)

    compiled = torch.compile(lambda x, t: F.cross_entropy(x.float(), t))
    variants = {"eager": eager, "inductor": lambda: compiled(x, t),
                "kasoku": lambda: ce.cross_entropy(x, t)}
    ref = eager()
    ref.backward()
    ref_grad, x.grad = x.grad.clone(), None
    nbytes = 3 * x.numel() * x.element_size()
    rows = []
    for name, fn in variants.items():
        configs = [(ce.BLOCK, ce.WARPS)] if name != "kasoku" else \
            [(2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
        for block, warps in configs:
            ce.BLOCK, ce.WARPS = block, warps
            loss = fn()
            loss.backward()
            grad, x.grad = x.grad.clone(), None
            err = (grad.float() - ref_grad.float()).abs().max().item()

            def step():
                fn().backward()
                x.grad = None
            fwd_ms = timed(lambda: fn().detach())
            ms = timed(step)
            row = {"variant": name, "block": block, "warps": warps, "loss": loss.item(),
                   "loss_diff": abs(loss.item() - ref.item()), "grad_max_err": err,
                   "fwd_ms": fwd_ms, "fwd_bwd_ms": ms,
                   "gb_per_s_of_needed": nbytes / (ms / 1e3) / 1e9}
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
