"""The second-batch-size disagreement of ``wgrad_ddp_order.py``, on the CPU: does it need the
second CUDA stream? DDP over gloo (a world of one), ``small_resnet`` with 1x1 convolutions as
matrix products, the ``--wgrad-stream`` layers forced on (off CUDA their products run inline),
bf16 autocast, compiled after the wrap as kasoku compiles; a first build at batch 8, then the
step with and without the lever at batch 16 (torch.compile's build for a symbolic batch with
``dyn``, ``dynamic=False`` with ``static``). Prints the worst ``max|a - b| / max|b|``.

    python research/probes/wgrad_dynamic_cpu.py dyn|static [ddp|plain]

On the 2-core development VM (2026-11-29, torch 2.13.0+cpu): 0.0 with ``dyn`` and ``static``
alike, with DDP. The graph-level code agrees; what went wrong on the H200 needs the stream.
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from test_wgrad_stream import small_resnet  # noqa: E402

from kasoku.accel.conv_matmul import apply_matmul_1x1  # noqa: E402
from kasoku.accel.wgrad_stream import convert  # noqa: E402


def grads(start, lever: bool, batch: int, static: bool, use_ddp: bool):
    m = small_resnet()
    m.load_state_dict(start)
    m = apply_matmul_1x1(m)
    if lever:
        assert convert(m)
    m = DDP(m) if use_ddp else m
    m.compile(dynamic=False if static else None)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), generator=g)
    for _ in range(2):
        for p in m.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x).float(), y)
        loss.backward()
    return [p.grad.float().clone() for p in m.parameters()]


def main():
    mode, use_ddp = sys.argv[1], len(sys.argv) < 3 or sys.argv[2] == "ddp"
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        start, static = small_resnet().state_dict(), mode == "static"
        grads(start, True, 8, static, use_ddp)  # the first build, at another batch size
        plain, lever = (grads(start, w, 16, static, use_ddp) for w in (False, True))
        worst = max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-30))
                    for u, v in zip(lever, plain))
        print(mode, "ddp" if use_ddp else "plain", "worst", round(worst, 4))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
