"""``mnist-mlp``: seed 001's first study, Chainer's MNIST example (98% val. acc. in 20 epochs)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.workloads.dataset_facts import require_root
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    from torch import nn

SYNTHETIC_SIZES = (10000, 1000)
"""Default synthetic (train, val) sizes; generation is per sample, so not the real 60k/10k."""


@register_workload("mnist-mlp")
class MnistMLP(Workload):
    description = "MLP 784-1000-1000-10 (ReLU) on MNIST 60k/10k"
    # Chainer's train_mnist.py as run in seed 001: Adam (alpha 1e-3), batch 100, 20 epochs.
    # The 10,000 validation images in one batch: 40 MB per layer's activations, and a tenth
    # of the launches of batches of 1,000 (on an H200 the evaluation in batches of 1,000
    # took ~6 ms of an ~100 ms epoch, most of it host time launching kernels).
    recipe = Recipe(optimizer="adam", lr=1e-3, batch_size=100, epochs=20,
                    eval_batch_size=10000)
    epoch_samples = 60_000

    def build_model(self) -> nn.Module:
        from kasoku.models import MLP  # deferred: torch (workloads.registry's doc)
        return MLP(784, 1000, 10, depth=2)

    def build_datasets(self, data: DataConfig, seed: int = 0):
        from kasoku.data.mnist import mnist_datasets  # deferred: torch
        from kasoku.data.transforms import ToUnitFloat  # deferred: torch
        from kasoku.workloads.common import synthetic_image_datasets  # deferred: torch
        if data.synthetic:
            # uint8 pixels -> float32 in [0, 1], as kasoku.data.mnist delivers the real images.
            return synthetic_image_datasets(data, (1, 28, 28), 10, SYNTHETIC_SIZES,
                                            ToUnitFloat(), seed=seed, name="synthetic-mnist")
        root = require_root(
            data, self.name,
            "the four MNIST files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz)",
            f"Get them with `kasoku data download mnist {flag('data_download.out')} DIR` (or add "
            f"{flag('data.download')}).")
        return mnist_datasets(root, download=data.download)
