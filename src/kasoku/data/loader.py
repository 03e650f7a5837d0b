"""``SerialLoader``: the Chainer-style iterator every kasoku trainer pulls batches from.

The order of epoch ``e`` is a permutation drawn from a generator seeded with ``(seed, e)``
alone, so the loader's whole state is ``(epoch, position)``: a resumed run, in any process,
continues with exactly the batch the interrupted run would have taken next.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from kasoku.data.bad_files import BadFileList, BadFileRecord

_STRUCTURE_KEYS = ("batch_size", "dataset_len", "world_size", "drop_last")
"""State keys that fix the batch layout: a snapshot taken under others cannot resume here."""


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch ``epoch``'s order: a pure function of ``(seed, epoch)``."""
    return ((seed & 0xFFFFFFFF) << 32) | (epoch & 0xFFFFFFFF)


class SerialLoader:
    """Batches of ``dataset`` in the calling process.

    ``next(loader) -> (inputs, targets)`` forever (``repeat=True``) or for one pass
    (``repeat=False``, then ``StopIteration``; ``reset()`` rewinds). Each batch is one slice
    of the epoch's index tensor and one ``dataset.get_batch(indices)`` when the dataset has
    it, else ``dataset[i]`` per sample, stacked (tensors and arrays stacked, numbers become
    int64/float32 tensors). ``dataset.set_epoch(epoch)`` is called whenever an epoch's order
    is drawn (at its start, and on the first batch after a resume).

    Sharding: rank ``r`` of ``world_size`` takes every ``world_size``-th index of the epoch's
    permutation, starting at ``r``; the permutation is padded by wrapping around so every
    rank gets ``ceil(len(dataset) / world_size)`` samples (as ``DistributedSampler`` does).
    ``drop_last`` drops the last incomplete batch of a rank's epoch. ``pad=False`` (for
    evaluation): no wrap-around, rank ``r`` takes indices ``r, r + world_size, ...`` and the
    ranks' shares differ by at most one sample, each sample seen once in all.

    A state taken with another number of ranks (a run resumed on more or fewer workers) is
    continued from the same sample position of its epoch: the ranks together had consumed the
    first ``position x batch_size x world_size`` samples of the epoch's permutation, and go on
    from there (rounded down to a whole step of the new layout).

    A ``kasoku.data.base.Loader``: one batch per call (``batches_per_call``,
    ``last_chunk_batches``: 1), no worker to stop (``close``).
    """
    batches_per_call = 1
    last_chunk_batches = 1

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, repeat: bool = True, rank: int = 0,
                 world_size: int = 1, pad: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dataset, self.batch_size, self.shuffle = dataset, int(batch_size), shuffle
        self.seed, self.drop_last, self.repeat = int(seed), drop_last, repeat
        self.rank, self.world_size, self.pad = rank, world_size, pad
        self.dataset_len = len(dataset)
        if self.dataset_len == 0:
            raise ValueError(f"{dataset!r} is empty: a loader needs at least one sample")
        self.samples_per_rank = math.ceil(self.dataset_len / world_size) if pad else \
            len(range(rank, self.dataset_len, world_size))
        rounding = math.floor if drop_last else math.ceil
        self.batches_per_epoch = rounding(self.samples_per_rank / self.batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{self.samples_per_rank} samples per rank make no full batch of "
                             f"{self.batch_size} with drop_last=True; lower the batch size")
        # Chosen once, so fetching a batch never asks which path it is on.
        self._fetch = dataset.get_batch if hasattr(dataset, "get_batch") else self._fetch_items
        self._set_epoch = getattr(dataset, "set_epoch", None)
        self.reset()

    def reset(self) -> None:
        """Rewind to the start of epoch 0 (the Evaluator does this before each pass)."""
        self.epoch, self.position, self.is_new_epoch = 0, 0, False
        self._order: torch.Tensor | None = None

    @property
    def epoch_detail(self) -> float:
        """Epochs completed, with the fraction of the current one."""
        return self.epoch + self.position / self.batches_per_epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    @property
    def bad_file_list(self) -> BadFileList | None:
        """The bad files skipped so far (``kasoku.data.bad_files``): the dataset's
        ``bad_files`` (``ImageFolder`` without ``strict``); None for datasets that have none."""
        bad = getattr(self.dataset, "bad_files", None)
        return bad if isinstance(bad, BadFileList) else None

    @property
    def skipped_records(self) -> list[BadFileRecord]:
        """The bad files skipped so far, ``(path, reason)`` each, in the order they were met."""
        bad = self.bad_file_list
        return bad.since(0) if bad is not None else []

    @property
    def skipped_files(self) -> list[str]:
        """Paths of the bad files skipped so far (sorted)."""
        return sorted(r.path for r in self.skipped_records)

    @property
    def skipped(self) -> int:
        """How many bad files were skipped so far."""
        bad = self.bad_file_list
        return len(bad) if bad is not None else 0

    def __iter__(self):
        return self

    def close(self) -> None:
        """Nothing to stop: the batches are made in the calling process."""

    def __next__(self):
        self._start_epoch_if_needed()
        start = self.position * self.batch_size
        batch = self._fetch(self._order[start:start + self.batch_size])
        self._advance(1)
        return batch

    def _start_epoch_if_needed(self) -> None:
        """Draw the epoch's order (and tell the dataset the epoch) before its first batch."""
        if self._order is None:
            if not self.repeat and self.epoch > 0:
                raise StopIteration
            self._order = self.epoch_indices(self.epoch)
            if self._set_epoch is not None:
                self._set_epoch(self.epoch)

    def _advance(self, batches: int) -> None:
        self.position += batches
        self.is_new_epoch = self.position == self.batches_per_epoch
        if self.is_new_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in order (int64, length a multiple of the
        batch size when ``drop_last``)."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        if not self.pad:
            return order[self.rank::self.world_size]
        total = self.samples_per_rank * self.world_size
        if total > n:
            order = order.repeat(math.ceil(total / n))[:total]
        shard = order[self.rank:total:self.world_size]
        if self.drop_last:
            shard = shard[:self.batches_per_epoch * self.batch_size]
        return shard

    def _fetch_items(self, indices: torch.Tensor):
        samples = [self.dataset[i] for i in indices.tolist()]
        return tuple(_stack(field) for field in zip(*samples))

    def state_dict(self) -> dict:
        """Everything exact resume needs (plain ints and bools)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "is_new_epoch": self.is_new_epoch, "batch_size": self.batch_size,
                "dataset_len": self.dataset_len, "world_size": self.world_size,
                "drop_last": self.drop_last, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken. Refuses (ValueError) a state whose batch size,
        dataset length, world size or drop_last differ: its position would mean other samples."""
        mine = self.state_dict()
        wrong = [f"{k}: snapshot {state[k]!r}, now {mine[k]!r}"
                 for k in _STRUCTURE_KEYS if k in state and state[k] != mine[k]
                 and k != "world_size"]
        if wrong:
            raise ValueError("cannot resume this loader from a state of another data layout ("
                             + "; ".join(wrong) + "); resume with the settings of the snapshot")
        self.seed, self.shuffle = int(state["seed"]), bool(state.get("shuffle", self.shuffle))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.is_new_epoch = bool(state.get("is_new_epoch", False))
        self._order = None
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            self.position = self.rescaled_position(self.position, saved_world)

    def rescaled_position(self, position: int, saved_world: int) -> int:
        """The position of this layout at which the samples a ``saved_world``-rank layout had
        consumed at ``position`` are consumed (rounded down: a few samples may come twice)."""
        consumed = position * self.batch_size * saved_world
        return min(consumed // (self.batch_size * self.world_size), self.batches_per_epoch)

    def __repr__(self) -> str:
        return (f"SerialLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, rank={self.rank}/{self.world_size})")


def _stack(values: tuple):
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    if isinstance(first, (bool, np.bool_)):
        return torch.tensor(values, dtype=torch.bool)
    if isinstance(first, numbers.Integral):
        return torch.tensor(values, dtype=torch.int64)
    if isinstance(first, numbers.Real):
        return torch.tensor(values, dtype=torch.float32)
    raise TypeError(f"cannot batch samples of type {type(first).__name__}: return tensors, "
                    f"numpy arrays or numbers from __getitem__, or give the dataset get_batch()")
