"""Activation checkpointing: memory for time, block by block.

A transformer's backward needs what its forward computed; kept whole, those activations grow
with batch x sequence x width x layers and are what fills a card first. Checkpointing keeps
less and recomputes the rest in the backward pass, one block at a time (the blocks of a
``blocks`` ``nn.ModuleList``, as ``kasoku.models.gpt`` builds them):

- ``full``: each block's forward under ``torch.utils.checkpoint`` (non-reentrant); only the
  block's input is kept, and the whole block runs again in the backward pass (about one more
  forward: a third more compute).
- ``selective``: PyTorch's selective checkpointing (``create_selective_checkpoint_contexts``)
  with an operator policy in the manner of torchtitan's "op" SAC: the outputs of the matrix
  products and of the fused attention kernels are saved, the cheap element-wise operators
  (layer norm, GELU, residual adds, views) recomputed. torchtitan saves every other matrix
  product to save more; kasoku saves them all, so the backward recomputes no matrix product.

Each block is recast (``kasoku.accel._recast``): the same Parameters, the same ``state_dict``
keys, so snapshots load with or without the lever. Apply it before compilation (dynamo traces
the checkpoint as one region) and before a data-parallel wrap.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from kasoku.accel._recast import recast
from kasoku.accel.config import CHECKPOINTING_MODES
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

_SAVED_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_fused_attention_overrideable")
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_OPS
                      if hasattr(torch.ops.aten, name))
"""The operators whose outputs selective checkpointing keeps: matrix products and the fused
attention kernels of every backend this build of PyTorch has (the plain attention's scores
are ``bmm`` outputs; its mask and softmax are recomputed)."""


def save_products(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy: save what costs FLOPs to recompute, recompute the
    rest."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(save_products)


class _Checkpointed:
    """Mixin of a recast block: its forward under ``torch.utils.checkpoint``."""

    _selective = False

    def forward(self, *args, **kwargs):
        run = super().forward  # the block's own forward, recomputed in the backward pass
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return run(*args, **kwargs)
        extra = {"context_fn": _selective_contexts} if self._selective else {}
        return checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)


@functools.cache
def _checkpointed_class(cls: type, selective: bool) -> type:
    name = f"{'Selective' if selective else ''}Checkpointed{cls.__name__}"
    return type(name, (_Checkpointed, cls), {"_selective": selective,
                                            "__module__": cls.__module__})


def checkpointable_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's ``blocks`` ``nn.ModuleList`` (through a wrapper's ``module``), or None."""
    blocks = getattr(model, "blocks", None)
    if blocks is None and isinstance(getattr(model, "module", None), nn.Module):
        blocks = getattr(model.module, "blocks", None)
    return blocks if isinstance(blocks, nn.ModuleList) and len(blocks) else None


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint each of ``model.blocks`` in ``mode`` (none | full | selective), in place;
    returns the model. A model without a ``blocks`` ModuleList is refused (``ConfigError``):
    kasoku would not know where one unit of recomputation ends."""
    if mode not in CHECKPOINTING_MODES:
        raise ConfigError(f"unknown activation checkpointing {mode!r}; choose one of "
                          f"{', '.join(CHECKPOINTING_MODES)}")
    if mode == "none":
        return model
    blocks = checkpointable_blocks(model)
    if blocks is None:
        raise ConfigError(f"{flag('accel.activation_checkpointing')} {mode}: "
                          f"{type(model).__name__} has no `blocks` ModuleList (the units to "
                          "recompute, as kasoku's gpt has); leave it at none for this model")
    selective = mode == "selective"
    for i, block in enumerate(blocks):
        if isinstance(block, _Checkpointed):
            raise ConfigError(f"{flag('accel.activation_checkpointing')}: the model's blocks are "
                              "checkpointed already")
        blocks[i] = recast(block, _checkpointed_class(type(block), selective))
    return model
