"""Synthetic data of a workload's real shapes, for throughput work and machines without data.

Samples are generated from their index (no storage), so any size is free, every process sees
the same sample for the same index, and resume stays exact.
"""
from __future__ import annotations

import torch


class SyntheticDataset:
    """``n`` samples: inputs of ``input_shape`` and either class labels in ``[0, num_classes)``
    or regression targets of ``target_shape``.

    ``dtype=torch.uint8`` draws pixel-like bytes; a float dtype draws standard normals. The
    label of a sample depends on its input (the sign of a fixed projection), so a model can
    actually learn it: "loss goes down" checks mean something on synthetic data too.
    """

    def __init__(self, n: int, input_shape: tuple[int, ...], num_classes: int | None = None,
                 target_shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, name: str = "synthetic"):
        if (num_classes is None) == (target_shape is None):
            raise ValueError("give exactly one of num_classes (classification) or target_shape")
        if n <= 0:
            raise ValueError(f"a synthetic dataset needs at least one sample, got n={n}")
        self.n, self.input_shape, self.num_classes = n, tuple(input_shape), num_classes
        self.target_shape = tuple(target_shape) if target_shape is not None else None
        self.dtype, self.seed, self.name = dtype, seed, name
        g = torch.Generator().manual_seed(seed ^ 0x5EED)
        outputs = num_classes if num_classes is not None else _numel(self.target_shape)
        # Labels depend on a fixed random subset of at most 4096 input elements: large inputs
        # (224x224 images) keep label computation cheap, so it never limits throughput work.
        numel = _numel(self.input_shape)
        self._features = torch.randperm(numel, generator=g)[:4096].sort().values
        self._projection = torch.randn(len(self._features), outputs, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        x, t = self.get_batch(torch.tensor([index]))
        return x[0], t[0]

    def _sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        if self.dtype == torch.uint8:
            return torch.randint(0, 256, self.input_shape, generator=g, dtype=torch.uint8)
        return torch.randn(self.input_shape, generator=g).to(self.dtype)

    def get_batch(self, indices: torch.Tensor):
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.n):
            raise IndexError(f"{self.name}: index out of range for {self.n} samples")
        x = torch.stack([self._sample(int(i)) for i in indices])
        features = x.flatten(1)[:, self._features].float()
        if self.dtype == torch.uint8:
            features -= 127.5  # centred, so labels are balanced across classes
        score = features @ self._projection
        if self.num_classes is not None:
            return x, score.argmax(dim=1)
        t = torch.tanh(score / self._projection.shape[0] ** 0.5)
        return x, t.reshape(len(x), *self.target_shape)

    def __repr__(self) -> str:
        return f"SyntheticDataset({self.name}, n={self.n}, input={self.input_shape})"


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel
