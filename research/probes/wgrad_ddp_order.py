"""Which earlier work in the process makes the graphed DDP comparison of
``tests/test_wgrad_stream.py`` fail? Alone it passes; after the file's other CUDA tests it
failed twice on an H200 (87% of a 1x1 convolution's weight gradient off). Each sequence runs in
a fresh process; the last item is always the graphed DDP comparison.

    python research/probes/wgrad_ddp_order.py            # all sequences
    python research/probes/wgrad_ddp_order.py ITEM...    # one sequence, in this process

Items: side:EAGER|COMPILED|GRAPH (test_cuda_side_stream_gradients_match_one_stream),
ddp:eager|graph (test_cuda_ddp_reads_side_stream_gradients_once_made), reset
(torch._dynamo.reset()), static (automatic dynamic shapes off), side128 (the side test's
graph case at batch 128), ddp64 (the DDP graph case at batch 64).

On an H200 (2026-11-29, torch 2.11.0+cu130, before the fix), the DDP graph case at batch 128:
  - after side:GRAPH or side:COMPILED (batch 64): FAILED, 456,936 of 524,288 elements of a
    1x1 convolution's weight gradient off (87%), greatest relative difference 1.005;
  - after ddp64: FAILED, the same;
  - after side:EAGER, after ddp:graph (128), after side128, alone: passed;
  - after side:GRAPH then reset, or with static first: passed.
A second batch size makes torch.compile compile again for a symbolic batch dimension, and
that build's step was wrong. kasoku now compiles graphed and second-stream steps for static
shapes; with it the test file (its graph case now builds at 64, then 128) passed on an H200.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SEQUENCES = [
    ["side:GRAPH", "ddp:graph"],
    ["side:COMPILED", "ddp:graph"],
    ["side:EAGER", "ddp:graph"],
    ["side:GRAPH", "reset", "ddp:graph"],
    ["ddp:graph", "ddp:graph"],
    # second call: the shapes (the side test's batch is 64, the DDP test's 128)
    ["side128", "ddp:graph"],
    ["static", "side:GRAPH", "ddp:graph"],
    ["ddp64", "ddp:graph"],
]


def ddp_graph(t, batch):
    """The DDP test's graph case at another batch size."""
    import socket

    from kasoku.distributed import World, ddp
    from kasoku.distributed.config import DistConfig
    from kasoku.distributed.fsdp import data_parallel
    with socket.socket() as s:
        s.bind(("localhost", 0))
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(s.getsockname()[1]))
    dev = torch.device("cuda", 0)
    ddp.join(World(), dev, 120.0)
    try:
        cfg = t.AccelConfig(precision="bf16", channels_last=True, matmul_1x1=True, compile=True,
                            optimizer_impl="fused", cuda_graph=True)
        t.assert_same_gradients(cfg, dev, batch=batch, steps=16,
                                distribute=lambda: data_parallel(DistConfig(gpus=1), dev, "bf16"))
    finally:
        ddp.leave()


def run(items):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    import test_wgrad_stream as t
    cases = {"EAGER": (False, False), "COMPILED": (True, False), "GRAPH": (True, True)}
    for item in items:
        kind, _, arg = item.partition(":")
        try:
            if kind == "side":
                t.test_cuda_side_stream_gradients_match_one_stream(*cases[arg])
            elif kind == "reset":
                torch._dynamo.reset()
            elif kind == "static":
                torch._dynamo.config.automatic_dynamic_shapes = False
            elif kind == "side128":
                t.assert_same_gradients(t.AccelConfig(
                    precision="bf16", channels_last=True, matmul_1x1=True, compile=True,
                    optimizer_impl="fused", cuda_graph=True), torch.device("cuda"), 128, 14)
            elif kind == "ddp64":
                ddp_graph(t, 64)
            else:
                with pytest.MonkeyPatch.context() as mp:
                    t.test_cuda_ddp_reads_side_stream_gradients_once_made(arg == "graph", mp)
            print(f"  {item}: passed", flush=True)
        except AssertionError as exc:
            said = [line for line in str(exc).splitlines()
                    if "Mismatched" in line or "relative" in line]
            print(f"  {item}: FAILED " + " | ".join(said), flush=True)


def main():
    if len(sys.argv) > 1:
        run(sys.argv[1:])
        return
    for seq in SEQUENCES[int(os.environ.get("FROM", "0")):]:
        print(" -> ".join(seq), flush=True)
        try:
            out = subprocess.run([sys.executable, __file__, *seq], capture_output=True,
                                 text=True, timeout=300)
        except subprocess.TimeoutExpired:
            print("  (no result within 300 s)", flush=True)
            continue
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith("  ")),
              flush=True)
        if out.returncode:
            print(out.stderr[-800:])


if __name__ == "__main__":
    main()
