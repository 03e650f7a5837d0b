"""Model FLOPs of one training step (forward, loss, backward), counted with
``torch.utils.flop_counter.FlopCounterMode`` rather than guessed from a formula.

What is counted is what the MFU convention counts: matrix products and convolutions (mm,
addmm, bmm, convolution and its backward, attention), forward and backward. Elementwise work,
normalization and the optimizer update are not counted; they are memory-bound and add little
arithmetic. Backward is counted as it actually runs: the first layer computes no gradient for
its input (the data needs none), so an MLP's backward is 2x its forward minus that term, not
exactly 2x.

The count runs on a meta-device copy of the model at the real batch size: no memory, no
arithmetic, exact shapes, and the model itself is left untouched. A model that cannot run on
meta is counted on a CPU copy at batch 2 and scaled linearly (exact for layers whose products
are linear in the batch, which covers conv, linear and recurrent nets); ``StepFlops.method``
says which was used.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

BatchFn = Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
FALLBACK_BATCH = 2
"""Batch of the CPU fallback count (batch norm needs more than one value per channel)."""


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step at ``batch_size`` (forward includes the loss)."""
    forward: int
    backward: int
    batch_size: int
    by_op: dict[str, int]
    method: str
    """"meta" (counted at the real batch size) or "cpu-batch-2-scaled"."""

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def per_sample(self) -> float:
        return self.total / self.batch_size


def count_step_flops(model: nn.Module, make_batch: BatchFn,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     batch_size: int) -> StepFlops:
    """Count the FLOPs of one forward + loss + backward of ``model`` (on any device; a copy
    is counted) on ``make_batch(batch_size, device)``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    try:
        forward, backward, by_op = _count(meta_copy(model), make_batch, loss_fn, batch_size,
                                          torch.device("meta"))
        return StepFlops(forward, backward, batch_size, by_op, "meta")
    except (NotImplementedError, RuntimeError):
        # Some operator has no meta kernel: count a small real batch and scale.
        pass
    small = min(batch_size, FALLBACK_BATCH)
    forward, backward, by_op = _count(copy.deepcopy(model).cpu(), make_batch, loss_fn, small,
                                      torch.device("cpu"))
    scale = batch_size / small
    return StepFlops(round(forward * scale), round(backward * scale), batch_size,
                     {k: round(v * scale) for k, v in by_op.items()},
                     f"cpu-batch-{small}-scaled")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device; no tensor
    data is copied, whatever device the model is on."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _count(model, make_batch, loss_fn, batch_size, device):
    model.train()
    inputs, targets = make_batch(batch_size, device)
    with FlopCounterMode(display=False) as fwd:
        loss = loss_fn(model(inputs), targets)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    by_op: dict[str, int] = {}
    for counter in (fwd, bwd):
        for op, n in counter.get_flop_counts().get("Global", {}).items():
            by_op[str(op)] = by_op.get(str(op), 0) + int(n)
    return int(fwd.get_total_flops()), int(bwd.get_total_flops()), by_op
