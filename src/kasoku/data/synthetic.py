"""Synthetic data of a workload's real shapes, for throughput work and machines without data.

Small datasets (up to ``MATERIALIZE_BYTES``) are generated once, in one call, and gathered a
batch at a time, so the data never limits a small model's throughput. Larger ones generate each
sample from its index on demand (no storage), so any size is free. Either way every process
sees the same sample for the same index, and resume stays exact.
"""
from __future__ import annotations

import torch

MATERIALIZE_BYTES = 256 * 2**20


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
        self._inputs = self._targets = None
        if n * numel * dtype.itemsize <= MATERIALIZE_BYTES:
            self._inputs = self._draw((n, *self.input_shape),
                                      torch.Generator().manual_seed(seed * 1_000_003))
            self._targets = self._label(self._inputs)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        x, t = self.get_batch(torch.tensor([index]))
        return x[0], t[0]

    def _draw(self, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        if self.dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return torch.randn(shape, generator=g).to(self.dtype)

    @property
    def sample_bytes(self) -> int:
        """The bytes of one sample's input."""
        return _numel(self.input_shape) * self.dtype.itemsize

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index``'s input, drawn from its index alone (as ``get_batch`` draws it
        where the dataset is not held whole)."""
        return self._sample(index)

    def label(self, x: torch.Tensor) -> torch.Tensor:
        """The labels (or targets) of the inputs ``x``, a batch."""
        return self._label(x)

    def _sample(self, index: int) -> torch.Tensor:
        return self._draw(self.input_shape,
                          torch.Generator().manual_seed(self.seed * 1_000_003 + 1 + int(index)))

    def get_batch(self, indices: torch.Tensor):
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.n):
            raise IndexError(f"{self.name}: index out of range for {self.n} samples")
        if self._inputs is not None:
            return self._inputs[indices], self._targets[indices]
        x = torch.stack([self._sample(int(i)) for i in indices])
        return x, self._label(x)

    def _label(self, x: torch.Tensor) -> torch.Tensor:
        features = x.flatten(1)[:, self._features].float()
        if self.dtype == torch.uint8:
            features -= 127.5  # centred, so labels are balanced across classes
        score = features @ self._projection
        if self.num_classes is not None:
            return score.argmax(dim=1)
        t = torch.tanh(score / self._projection.shape[0] ** 0.5)
        return t.reshape(len(x), *self.target_shape)

    def __repr__(self) -> str:
        return f"SyntheticDataset({self.name}, n={self.n}, input={self.input_shape})"


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel
