"""The activation memory of a step, measured on any device: the bytes a forward pass leaves
alive for its backward pass.

``torch.autograd.graph.saved_tensors_hooks`` alone cannot count them under activation
checkpointing: ``torch.utils.checkpoint`` installs hooks of its own inside each checkpointed
region (which take precedence over an outer hook and drop what they are handed), and selective
checkpointing keeps the outputs it saves in a cache of its own. So the count follows the
storages instead: every storage an operator of the forward creates is recorded (a
``TorchDispatchMode``, which sees the operators under autograd and under checkpointing's own
modes), and those still alive when the forward has returned are what the step holds until its
backward pass: autograd's saved tensors, a checkpoint's inputs, selective checkpointing's
saved outputs, whoever holds them. Parameters, buffers and the batch are not counted, nor the
loss. Each storage counts once, whatever views of it were saved. A tensor subclass that wraps
others (torchao's float8 tensors: the float8 data and its scale) counts as the tensors it
wraps: it has no storage of its own.
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class _Created(TorchDispatchMode):
    """Records a weak reference to every storage the operators it sees create."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing
        self.created: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain(tree_leaves(out)):
            if t.layout == torch.strided:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                known = self.created.get(ptr)
                # A freed storage's address may be handed to a later one: count the later.
                if ptr and ptr not in self.existing and (known is None or known[0]() is None):
                    self.created[ptr] = (weakref.ref(storage), storage.nbytes())
        return out


def _plain(leaves):
    """The plain tensors among ``leaves``, a wrapper subclass replaced by those it wraps."""
    for t in leaves:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from _plain(getattr(t, name) for name in names)
        elif isinstance(t, torch.Tensor):
            yield t


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor],
                           keep: tuple = ()) -> int:
    """Bytes of storages created by ``forward()`` (the forward and the loss, returning the
    loss) still alive when it returns, less the loss's own: what the step keeps for its
    backward pass. ``model``'s parameters and buffers and the tensors in ``keep`` (the batch)
    are never counted. Runs ``forward`` once, with gradients as they are; the caller runs the
    backward (or drops the loss) afterwards."""
    existing = {t.untyped_storage().data_ptr()
                for t in _plain([*model.parameters(), *model.buffers(), *keep])}
    mode = _Created(existing)
    with mode:
        loss = forward()
    gc.collect()  # reference cycles of the forward's frames are not activations
    own = {t.untyped_storage().data_ptr() for t in _plain([loss])}
    return sum(nbytes for ptr, (ref, nbytes) in mode.created.items()
               if ptr not in own and ref() is not None)
