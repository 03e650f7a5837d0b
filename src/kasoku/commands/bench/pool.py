"""A pool of synthetic batches of a workload's real shapes, made directly on the device.

The shapes, dtypes and value range come from one sample of the workload's own synthetic
dataset (the same transform the real data goes through: float32 images normalized, or in
[0, 1] for MNIST); class counts come from the model's output. The pool is generated on the
device with a seeded generator, so no host-to-device copy or loader sits in a measured step,
and every rung of a sweep sees the same batches (the numerics guard relies on it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kasoku.data.config import DataConfig
from kasoku.workloads.registry import Workload

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BatchSpec:
    input_shape: tuple[int, ...]
    """Per sample, e.g. (3, 224, 224)."""
    input_dtype: torch.dtype
    input_range: str
    """"unit" (values in [0, 1]), "normal" (standardized), "bytes" (uint8 pixels) or "tokens"
    (integer ids below ``num_classes``: a language model's vocabulary)."""
    num_classes: int | None
    """Class count for classification; None for regression."""
    target_shape: tuple[int, ...]
    """Per sample; () for class labels."""

    def describe(self) -> dict:
        return {"input_shape": list(self.input_shape),
                "input_dtype": str(self.input_dtype).removeprefix("torch."),
                "input_range": self.input_range,
                "target": (f"classes:{self.num_classes}" if self.num_classes is not None
                           else f"regression:{list(self.target_shape)}")}

    def make_batch(self, batch_size: int, device: torch.device,
                   generator: torch.Generator | None = None) -> Batch:
        """One batch; on the meta device (FLOP counting) no values are drawn."""
        shape = (batch_size, *self.input_shape)
        if self.input_range in ("bytes", "tokens"):
            high = 256 if self.input_range == "bytes" else self.num_classes
            x = torch.randint(0, high, shape, generator=generator, device=device,
                              dtype=self.input_dtype)
        elif self.input_range == "unit":
            x = torch.rand(shape, generator=generator, device=device).to(self.input_dtype)
        else:
            x = torch.randn(shape, generator=generator, device=device).to(self.input_dtype)
        if self.num_classes is not None:
            y = torch.randint(0, self.num_classes, (batch_size, *self.target_shape),
                              generator=generator, device=device)
        else:
            y = torch.randn((batch_size, *self.target_shape), generator=generator,
                            device=device).tanh()
        return x, y


def batch_spec(workload: Workload, model: nn.Module) -> BatchSpec:
    """Read the batch shapes of ``workload`` from two samples of its synthetic data, and the
    class count from ``model``'s output on them, its last dimension (no gradients, eval
    mode, so the model's state is left as it was)."""
    train, _ = workload.build_datasets(
        DataConfig(synthetic=True, synthetic_train_size=2, synthetic_val_size=1), seed=0)
    samples = [train[i] for i in range(2)]
    x = torch.stack([torch.as_tensor(s[0]) for s in samples])
    t = torch.stack([torch.as_tensor(s[1]) for s in samples])
    if x.dtype == torch.uint8:
        value_range = "bytes"
    elif not x.dtype.is_floating_point:
        value_range = "tokens"
    else:
        value_range = "unit" if float(x.min()) >= 0.0 else "normal"
    num_classes = None
    if not t.dtype.is_floating_point:
        device = next(model.parameters()).device
        training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(x.to(device))
        model.train(training)
        num_classes = int(logits.shape[-1])
    return BatchSpec(tuple(x.shape[1:]), x.dtype, value_range, num_classes, tuple(t.shape[1:]))


def make_pool(spec: BatchSpec, batch_size: int, device: torch.device, num_batches: int = 4,
              seed: int = 0) -> list[Batch]:
    """``num_batches`` distinct batches, generated on ``device`` from ``seed``."""
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"batch_size and num_batches must be >= 1, got {batch_size} and "
                         f"{num_batches}")
    g = torch.Generator(device=device).manual_seed(seed)
    return [spec.make_batch(batch_size, device, g) for _ in range(num_batches)]


def cycle(pool: list[Batch], steps: int, start: int = 0) -> list[Batch]:
    """The batches of ``steps`` consecutive steps, taken round-robin from the pool."""
    return [pool[(start + i) % len(pool)] for i in range(steps)]
