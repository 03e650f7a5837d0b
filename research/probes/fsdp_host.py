"""FSDP2's host time per step on a CPU, by how the model is wrapped (issue: a transformer
workload; GPT-2 small under FSDP2 was host-bound on 2 H200s). One gloo process, a gpt of 12
blocks 64 wide on 32 tokens, so the compute is small and the step is mostly host work:

    torchrun --nproc-per-node 1 research/probes/fsdp_host.py

Prints ms per step (median of 5 windows of 10 steps) alone and under each wrapping."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from kasoku.distributed import fsdp
from kasoku.models.gpt import GPT, GPTShape

SHAPE = GPTShape(n_layer=12, n_head=2, n_embd=64, block_size=32, vocab_size=256)


def step_ms(model, opt, x, y, windows=5, steps=10) -> float:
    def run(n):
        for _ in range(n):
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
    run(3)
    times = []
    for _ in range(windows):
        t0 = time.perf_counter()
        run(steps)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def wrapped(how: str):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    blocks = list(model.blocks)
    if how == "kasoku":
        fsdp.shard(model, torch.device("cpu"))
    elif how == "no-prefetch":
        for i, b in enumerate(blocks):
            fully_shard(b, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model)
    elif how == "keep-after-forward":
        for b in blocks:
            fully_shard(b, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
    elif how.startswith("groups-of-"):
        k = int(how.rsplit("-", 1)[1])
        for i in range(0, len(blocks), k):
            fully_shard(blocks[i:i + k], reshard_after_forward=i + k < len(blocks))
        fully_shard(model)
    elif how == "root-only":
        fully_shard(model)
    return model


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.randint(0, 256, (1, 32))
    y = torch.randint(0, 256, (1, 32))
    torch.manual_seed(0)
    alone = GPT(SHAPE)
    print(f"alone: {step_ms(alone, torch.optim.AdamW(alone.parameters(), foreach=True), x, y):.2f}"
          " ms/step")
    for how in ("kasoku", "no-prefetch", "keep-after-forward", "groups-of-2", "groups-of-4",
                "root-only"):
        model = wrapped(how)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        print(f"{how}: {step_ms(model, opt, x, y):.2f} ms/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
