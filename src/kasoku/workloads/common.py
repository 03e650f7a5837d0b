"""Pieces the workload modules share: synthetic train/val splits of a real dataset's shapes and
scale, and the CIFAR-10 workloads' datasets. (What they share without torch -- sizes, the error
for a missing real dataset -- is in ``dataset_facts``.)"""
from __future__ import annotations

from typing import Callable

import torch

from kasoku.core.flags import flag
from kasoku.data.cifar10 import cifar10_datasets
from kasoku.data.config import DataConfig
from kasoku.data.synthetic import SyntheticDataset
from kasoku.data.transforms import CIFAR10_MEAN, CIFAR10_STD, ToUnitFloat
from kasoku.workloads.dataset_facts import (
    CIFAR10_CONTENTS,
    CIFAR10_HOW_TO_GET,
    require_root,
    synthetic_sizes,
)

RESIDENT_BYTES = 8 * 2**30
"""A synthetic split up to this size can be held whole (``SyntheticSplit.in_memory``): what
the device loader puts on the GPU, where ``--synthetic`` makes its batches by default."""


class SyntheticSplit:
    """Samples ``[start, start + n)`` of a ``SyntheticDataset``, inputs passed through
    ``transform`` (a batch transform such as ``ToUnitFloat``: the real sets store uint8 and
    emit float, and synthetic data must reach the model in the same dtype and scale).

    Train and val are two disjoint ranges of one dataset rather than two seeds, because the
    label rule (a fixed random projection) derives from the seed: a second seed would label
    the validation images by a different rule, and validation accuracy would mean nothing."""

    def __init__(self, base: SyntheticDataset, start: int, n: int,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None, name: str):
        assert 0 <= start and start + n <= len(base), (start, n, len(base))
        self.base, self.start, self.n = base, start, n
        self.transform, self.name = transform, name

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        x, t = self.get_batch(torch.tensor([index]))
        return x[0], t[0]

    @property
    def held_in_memory(self) -> bool:
        """Whether these samples can be held as tensors: drawn whole already (a small base),
        or at most ``RESIDENT_BYTES`` of them."""
        return self.base._inputs is not None or self.nbytes <= RESIDENT_BYTES

    @property
    def nbytes(self) -> int:
        """The bytes of these samples' inputs."""
        return self.n * self.base.sample_bytes

    def in_memory(self) -> "InMemorySplit":
        """These samples as ``inputs``/``targets`` tensors (what the device loader copies to
        the GPU), the same samples ``get_batch`` gives for the same indices: sliced from a
        base drawn whole, else drawn here one by one as on demand (a second or two per
        thousand ImageNet-sized samples); up to ``RESIDENT_BYTES``."""
        if self.base._inputs is not None:
            span = slice(self.start, self.start + self.n)
            return InMemorySplit(self.base._inputs[span], self.base._targets[span],
                                 self.transform)
        if not self.held_in_memory:
            raise TypeError(f"{self.name}: {self.n} synthetic samples of this size "
                            f"({self.nbytes / 2**30:.1f} GiB) are drawn on demand, not held in "
                            f"memory (at most {RESIDENT_BYTES // 2**30} GiB); use "
                            f"{flag('data.synthetic_train_size')} N with a smaller N, or "
                            f"another loader")
        inputs = torch.empty((self.n, *self.base.input_shape), dtype=self.base.dtype)
        for i in range(self.n):
            inputs[i] = self.base.sample(self.start + i)
        return InMemorySplit(inputs, self.base.label(inputs), self.transform)

    def get_batch(self, indices: torch.Tensor):
        indices = torch.as_tensor(indices, dtype=torch.int64)
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.n):
            raise IndexError(f"{self.name}: index out of range for {self.n} samples")
        x, t = self.base.get_batch(indices + self.start)
        if self.transform is not None:
            x = self.transform(x)
        return x, t

    def __repr__(self) -> str:
        return f"SyntheticSplit({self.name}, n={self.n}, input={self.base.input_shape})"


def synthetic_image_datasets(data: DataConfig, input_shape: tuple[int, ...], num_classes: int,
                             default_sizes: tuple[int, int],
                             transform: Callable[[torch.Tensor], torch.Tensor] | None,
                             seed: int = 0, name: str = "synthetic"
                             ) -> tuple[SyntheticSplit, SyntheticSplit]:
    """``(train, val)`` uint8 images of ``input_shape`` with learnable labels, sized by
    ``data.synthetic_train_size`` / ``data.synthetic_val_size`` or else ``default_sizes``."""
    n_train, n_val = synthetic_sizes(data, default_sizes)
    base = SyntheticDataset(n_train + n_val, input_shape, num_classes=num_classes,
                            dtype=torch.uint8, seed=seed, name=name)
    return (SyntheticSplit(base, 0, n_train, transform, f"{name}-train"),
            SyntheticSplit(base, n_train, n_val, transform, f"{name}-val"))


class InMemorySplit:
    """A ``SyntheticSplit`` held as tensors: batches are ``transform(inputs[indices])``, on
    whatever device the tensors were moved to (``kasoku.data.device_loader.to_device``)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, transform):
        self.inputs, self.targets, self.transform = inputs, targets, transform

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        x, t = self.get_batch(torch.tensor([index]))
        return x[0], t[0]

    def get_batch(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.int64, device=self.inputs.device)
        x = self.inputs[indices]
        return (self.transform(x) if self.transform is not None else x), self.targets[indices]


def synthetic_cifar10(data: DataConfig, default_sizes: tuple[int, int], seed: int = 0):
    """Synthetic (3, 32, 32) images normalized with CIFAR-10's channel statistics, as
    ``kasoku.data.cifar10`` delivers the real ones."""
    return synthetic_image_datasets(data, (3, 32, 32), 10, default_sizes,
                                    ToUnitFloat(CIFAR10_MEAN, CIFAR10_STD), seed=seed,
                                    name="synthetic-cifar10")


def cifar10_holdout(data: DataConfig, workload: str, synthetic_sizes: tuple[int, int],
                    seed: int = 0, augment: bool = False):
    """``(train, val)`` of a CIFAR-10 workload: synthetic data of its shapes with
    ``data.synthetic``, else the holdout protocol on the real set in ``data.root`` (train on
    batches 1-4, validate on batch 5), the training batches cropped and flipped when
    ``augment``."""
    if data.synthetic:
        return synthetic_cifar10(data, synthetic_sizes, seed)
    root = require_root(data, workload, CIFAR10_CONTENTS, CIFAR10_HOW_TO_GET)
    return cifar10_datasets(root, train_batches=(1, 2, 3, 4), val_batches=(5,),
                            augment=augment, seed=seed, download=data.download)
