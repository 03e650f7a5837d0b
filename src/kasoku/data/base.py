"""The dataset contract every kasoku loader relies on, and the loader contract the trainer
relies on (``Loader``).

A dataset is a map-style object: ``len(ds)`` samples and ``ds[i] -> (input, target)``.
Two optional methods make it fast and reproducible:

* ``get_batch(indices: LongTensor) -> (inputs, targets)``: gather a whole batch at once
  (in-memory datasets); loaders use it instead of per-sample ``__getitem__`` + stacking.
* ``set_epoch(epoch: int)``: random augmentation derives its randomness from
  ``(seed, epoch, index)`` only, never from global RNG state, so the same sample gets the same
  augmentation in any process, any loader, and after a resume.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class Loader(Protocol):
    """What the trainer needs of its training loader; ``kasoku.data.loader.SerialLoader`` and
    every loader of ``kasoku.data.registry`` (and ``kasoku.data.prefetch``'s wrapper) are ones.

    ``next(loader)``: a batch ``(inputs, targets)``, or with ``batches_per_call`` K > 1 a
    chunk of up to K batches stacked, ``last_chunk_batches`` of them in the latest one;
    ``epoch``, ``epoch_detail`` (epochs done, with the fraction of the current one),
    ``is_new_epoch`` (the latest batch ended an epoch), ``batches_per_epoch`` (also ``len``);
    ``state_dict``/``load_state_dict``: its order and place, so a resumed run goes on with
    exactly the next batch; ``close``: its workers stopped (nothing to do for a loader that
    has none)."""
    batches_per_call: int
    last_chunk_batches: int
    epoch: int
    is_new_epoch: bool
    batches_per_epoch: int

    @property
    def epoch_detail(self) -> float: ...

    def __next__(self) -> tuple: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class ArrayDataset:
    """Samples held in memory as tensors, gathered a batch at a time.

    ``inputs`` and ``targets`` share their first dimension. ``transform``, if given, maps a
    batch of inputs to a batch of inputs (e.g. uint8 -> normalized float); it must be
    deterministic so resume stays exact.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 name: str = "array"):
        if len(inputs) != len(targets):
            raise ValueError(f"{name}: {len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets
        self.transform = transform
        self.name = name

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        x, t = self.get_batch(torch.tensor([index]))
        return x[0], t[0]

    def get_batch(self, indices: torch.Tensor):
        x = self.inputs[indices]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[indices]

    def __repr__(self) -> str:
        return f"ArrayDataset({self.name}, n={len(self)}, input={tuple(self.inputs.shape[1:])})"


LOADER_MEMBERS = (*Loader.__annotations__, *(
    name for name, value in vars(Loader).items()
    if isinstance(value, property) or callable(value) and name in ("__next__", "__len__")
    or callable(value) and not name.startswith("_")))
"""``Loader``'s members, read off the protocol, for the message that names those a loader
lacks (Python 3.10's typing keeps no public list of a protocol's members)."""


def check_loader(loader) -> None:
    """A ``TypeError`` naming what ``loader`` lacks of ``Loader``, if anything: a loader of
    one's own fails here, in one line, not at its first use deep in a step."""
    if isinstance(loader, Loader):
        return
    needs = [n for n in LOADER_MEMBERS if not hasattr(loader, n)]
    raise TypeError(f"the training loader ({type(loader).__name__}) is not a kasoku loader: it "
                    f"lacks {', '.join(sorted(needs)) or 'part of kasoku.data.base.Loader'} "
                    f"(kasoku.data.base.Loader says each; SerialLoader's batches_per_call and "
                    f"last_chunk_batches are 1)")
