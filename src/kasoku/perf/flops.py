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

A transformer's MFU is quoted by a formula instead (PaLM's, nanoGPT's:
``transformer_flops_per_token``), which its workload gives (``Workload.step_flops``), so its
figures read against the papers'.
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


def transformer_flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """A decoder-only transformer's training FLOPs per token, forward and backward, as the
    PaLM paper (Chowdhery et al. 2022, appendix B) and nanoGPT's ``estimate_mfu`` count them:
    ``6 N`` for the weights' matrix products (2 per parameter forward, 4 backward) plus
    ``12 n_layer n_embd seq_len`` for attention's two products with the keys and values
    (``Q K^T`` and ``A V``, each ``2 T d`` per token and layer forward, twice that backward;
    the causal mask's skipped half is counted, as those papers do). ``N``: the parameters
    whose products these are (a tied embedding counts once, as the head's weight; position
    embeddings are looked up, not multiplied, and are left out)."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


def transformer_step_flops(n_params: int, n_layer: int, n_embd: int, seq_len: int,
                           batch_size: int) -> StepFlops:
    """``transformer_flops_per_token`` for a step of ``batch_size`` sequences of ``seq_len``
    tokens, a third of it forward."""
    tokens = batch_size * seq_len
    weights = 6 * n_params * tokens
    attention = 12 * n_layer * n_embd * seq_len * tokens
    total = transformer_flops_per_token(n_params, n_layer, n_embd, seq_len) * tokens
    return StepFlops(total // 3, total - total // 3, batch_size,
                     {"weights (6N per token)": weights,
                      "attention (12 n_layer n_embd T per token)": attention},
                     "formula: 6N + 12 n_layer n_embd T per token (PaLM, nanoGPT)")
