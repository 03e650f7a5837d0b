"""The ``plain`` rung: the training loop a user writes from the PyTorch tutorial, with no
kasoku code in the step. It shares only the batch pool and the timing with the other rungs.

fp32 with TF32 off (set explicitly: cuDNN convolutions default to TF32), NCHW, cuDNN
autotuning off, the optimizer of the workload's recipe with PyTorch's default implementation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kasoku.optim import decay_groups
from kasoku.workloads.registry import Recipe


def setup_backends() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False


def make_optimizer(recipe: Recipe, params, lr: float | None = None) -> torch.optim.Optimizer:
    lr = recipe.lr if lr is None else lr
    betas = {"betas": recipe.betas} if recipe.betas is not None else {}
    if recipe.optimizer == "adamw":  # nanoGPT's groups: no decay on biases and norms
        return torch.optim.AdamW(decay_groups(list(params), recipe.weight_decay), lr=lr, **betas)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=recipe.weight_decay, **betas)
    momentum = recipe.momentum if recipe.optimizer == "momentum" else 0.0
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=recipe.weight_decay)


def train_steps(model, optimizer, batches, loss_fn=F.cross_entropy,
                grad_clip: float | None = None) -> torch.Tensor:
    """The textbook loop over ``batches``, with torch's ``clip_grad_norm_`` before each step
    where the recipe clips (``grad_clip``); returns the last loss (detached, no host sync)."""
    model.train()
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return loss.detach()
