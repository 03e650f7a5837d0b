"""``DeviceLoader``: the whole dataset resident on the device, no per-batch host work.

For datasets that fit (MNIST, CIFAR-10): the uint8 images are copied to the device once; each
batch is one gather with device-side indices, and the dataset's batch transform (uint8 ->
normalized float, crop + flip keyed on ``(seed, epoch, index)``) runs there as batched tensor
ops. The order, sharding and resume state are ``SerialLoader``'s, so on any device it yields
exactly the batches ``SerialLoader`` yields for the same seed.
"""
from __future__ import annotations

import copy

import torch

from kasoku.data.loader import SerialLoader


def to_device(dataset, device: torch.device):
    """A copy of an in-memory dataset (``inputs``/``targets`` tensors plus ``get_batch``, as
    ``ArrayDataset`` and its subclasses) with its tensors on ``device``."""
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


class DeviceLoader(SerialLoader):
    """``SerialLoader`` over a device-resident copy of ``dataset`` (see the module docstring).

    Takes the ``SerialLoader`` arguments plus ``device``. Each epoch's order is drawn on the
    host, as in ``SerialLoader``, and copied to the device once per epoch (a few hundred KB).
    """

    def __init__(self, dataset, batch_size: int, device="cuda", **kwargs):
        self.device = torch.device(device)
        self.source = dataset
        super().__init__(to_device(dataset, self.device), batch_size, **kwargs)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return super().epoch_indices(epoch).to(self.device)

    def __repr__(self) -> str:
        return (f"DeviceLoader({self.source!r}, batch_size={self.batch_size}, "
                f"device={self.device}, rank={self.rank}/{self.world_size})")
