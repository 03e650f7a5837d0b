"""The levers' end: what a run's step holds on the device, released before a data-parallel
worker leaves its process group.

A CUDA graph that captured NCCL collectives (DDP's all-reduce inside ``--cuda-graph``'s whole
step, or the graphs of a compile mode that captures its own) keeps the communicator's
resources registered with the graph. Destroying the process group while such a graph lives
waits on them: ``destroy_process_group`` never returns (pytorch/pytorch#115388; seen in
kasoku on 2 H100s, both workers stuck in it after their last epoch with every lever on).
So the order at the end of a worker is fixed: the device's queued work finished, the graphs
freed (``CudaGraphStep.release``), the compiled code dropped (``torch._dynamo.reset``, which
also frees the graphs of compile's own graphing modes), what refers to them collected, and
only then the process group destroyed (``kasoku.distributed.ddp.leave``).
"""
from __future__ import annotations

import gc
import sys

import torch

from kasoku.accel.graph import CudaGraphStep
from kasoku.train.step import Step, steps_of


def release_levers(step_fn: Step | None = None, device: torch.device | None = None) -> None:
    """Free the CUDA graphs of ``step_fn`` (a step as ``accelerate`` built it, wrappers
    included) and the compiled code of this process, after the device finished its queued
    work; call before ``ddp.leave``. Safe to call on any step, on any device, more than
    once."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    for step in steps_of(step_fn):
        if isinstance(step, CudaGraphStep):
            step.release()
    if "torch._dynamo" in sys.modules:  # compiled code exists only if dynamo was imported
        torch._dynamo.reset()
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)

