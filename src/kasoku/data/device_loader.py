"""``DeviceLoader``: the whole dataset resident on the device, no per-batch host work.

For datasets that fit (MNIST, CIFAR-10): the uint8 images are copied to the device once; each
batch is one gather with device-side indices, and the dataset's batch transform (uint8 ->
normalized float, crop + flip keyed on ``(seed, epoch, index)``) runs there as batched tensor
ops. The order, sharding and resume state are ``SerialLoader``'s, so on any device it yields
exactly the batches ``SerialLoader`` yields for the same seed.

``ChunkedLoader`` (which ``DeviceLoader`` extends) can hand out several batches per ``next()``
for a step that runs several optimizer steps per call (``kasoku.accel.multistep``): one
gather and one transform for all of them, one trainer iteration's host cost for all of them.
"""
from __future__ import annotations

import copy

import torch

from kasoku.data.loader import SerialLoader


def to_device(dataset, device: torch.device):
    """A copy of an in-memory dataset (``inputs``/``targets`` tensors plus ``get_batch``, as
    ``ArrayDataset`` and its subclasses; a dataset with ``in_memory()`` is asked for that form
    first, as synthetic sets are) with its tensors on ``device``."""
    if hasattr(dataset, "in_memory"):
        dataset = dataset.in_memory()
    if not (isinstance(getattr(dataset, "inputs", None), torch.Tensor)
            and isinstance(getattr(dataset, "targets", None), torch.Tensor)
            and hasattr(dataset, "get_batch")):
        raise TypeError(f"the device loader needs an in-memory dataset holding `inputs` and "
                        f"`targets` tensors (like kasoku's MNIST and CIFAR-10 sets); "
                        f"{dataset!r} is not one: use another loader for it")
    resident = copy.copy(dataset)
    resident.inputs = dataset.inputs.to(device)
    resident.targets = dataset.targets.to(device)
    return resident


class ChunkedLoader(SerialLoader):
    """``SerialLoader`` that hands out ``batches_per_call`` batches per ``next()``.

    With ``batches_per_call=K > 1``, ``next(loader)`` returns ``(inputs [k, B, ...], targets
    [k, B, ...])``: the next ``k`` batches of ``SerialLoader``'s order, made by one fetch of
    their ``k * B`` indices (one gather and one transform call for an in-memory dataset) and
    viewed as ``k`` batches. ``k = K`` except at the end of an epoch: a chunk never straddles
    an epoch boundary (``k`` = the batches left), and the epoch's last, incomplete batch
    (without ``drop_last``) comes alone as ``[1, b, ...]``. Concatenating the chunks gives
    exactly ``SerialLoader``'s batches. ``last_chunk_batches`` is the ``k`` of the latest
    chunk (the Updater counts that many iterations).

    ``position``, ``epoch``, ``epoch_detail``, ``is_new_epoch`` and ``batches_per_epoch`` count
    batches, as in ``SerialLoader``, so epoch triggers and schedules keep their meaning, and
    the state is ``SerialLoader``'s: a snapshot taken with another K (same batch layout)
    resumes at the right batch. With ``K = 1`` it is ``SerialLoader``: plain batches.

    The chunks need a step that takes them: ``kasoku.accel.multistep.MultiStep``
    (``accelerate`` with ``AccelConfig(steps_per_call=K)`` wraps the step in it).
    """

    def __init__(self, dataset, batch_size: int, batches_per_call: int = 1, **kwargs):
        if isinstance(batches_per_call, bool) or not isinstance(batches_per_call, int) \
                or batches_per_call < 1:
            raise ValueError(f"batches_per_call must be a whole number >= 1, got "
                             f"{batches_per_call!r}")
        self.batches_per_call = batches_per_call
        super().__init__(dataset, batch_size, **kwargs)
        # Complete batches of an epoch: every chunk is K long when K divides this.
        self.full_batches_per_epoch = self.samples_per_rank // self.batch_size

    def reset(self) -> None:
        super().reset()
        self.last_chunk_batches = 0

    def __next__(self):
        if self.batches_per_call == 1:
            batch = super().__next__()
            self.last_chunk_batches = 1
            return batch
        self._start_epoch_if_needed()
        k = self._chunk_batches(self.position)
        start = self.position * self.batch_size
        indices = self._order[start:start + k * self.batch_size]
        chunk = tuple(x.unflatten(0, (k, len(indices) // k)) for x in self._fetch(indices))
        self.last_chunk_batches = k
        self._advance(k)
        return chunk

    def _chunk_batches(self, position: int) -> int:
        """Batches in the chunk starting at batch ``position`` of an epoch."""
        full = self.full_batches_per_epoch
        return 1 if position >= full else min(self.batches_per_call, full - position)

    def __repr__(self) -> str:
        return (f"ChunkedLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"batches_per_call={self.batches_per_call}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world_size})")


class DeviceLoader(ChunkedLoader):
    """``SerialLoader`` over a device-resident copy of ``dataset`` (see the module docstring).

    Takes the ``SerialLoader`` arguments plus ``device`` and ``batches_per_call`` (see
    ``ChunkedLoader``). Each epoch's order is drawn on the host, as in ``SerialLoader``, and
    copied to the device once per epoch (a few hundred KB).
    """

    def __init__(self, dataset, batch_size: int, device="cuda", **kwargs):
        self.device = torch.device(device)
        self.source = dataset
        super().__init__(to_device(dataset, self.device), batch_size, **kwargs)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return super().epoch_indices(epoch).to(self.device)

    def __repr__(self) -> str:
        return (f"DeviceLoader({self.source!r}, batch_size={self.batch_size}, "
                f"batches_per_call={self.batches_per_call}, device={self.device}, "
                f"rank={self.rank}/{self.world_size})")
