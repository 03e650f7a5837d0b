"""Your own model with kasoku's commands: a small CNN that tells horizontal stripes from
vertical ones.

    kasoku train examples/stripes_cnn.py:StripesCNN
    kasoku bench examples/stripes_cnn.py:StripesCNN --batch-size 32,128
    kasoku train examples/stripes_cnn.py:wide_stripes_cnn --channels-last --compile

``FILE.py:NAME`` names a ``Workload`` subclass (``StripesCNN``) or a function that returns a
``Workload`` (``wide_stripes_cnn``). A workload is what one training study needs: a model, its
data (a training and a validation set), a loss, an accuracy and a default recipe. Everything
the built-in workloads get, this one gets too: the run folder, the log, snapshots and exact
resume, every loader of ``kasoku list`` and every lever (``--precision``, ``--compile``,
...), and ``kasoku bench``'s ladder.

The data is generated (no files), from the seed alone, so a run is reproducible. A dataset is
anything with ``len(ds)`` and ``ds[i] -> (input, target)``; ``ArrayDataset`` holds tensors
in memory and also gives loaders the fast ``get_batch`` path (and ``--loader device``).
"""
import math

import torch
from torch import nn

from kasoku import ArrayDataset, DataConfig, Recipe, Workload

SIZE = 32
"""Images are 1 x SIZE x SIZE."""


class StripesCNN(Workload):
    description = "small CNN: horizontal vs vertical stripes (generated)"
    recipe = Recipe(optimizer="adam", lr=1e-3, batch_size=64, epochs=2)
    sample_unit = "images"  # rates read "images/s"
    generated_data = True  # --data is ignored: there are no files

    def __init__(self, width: int = 16):
        self.width = width

    def build_model(self) -> nn.Module:
        w = self.width
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, 2))

    def build_datasets(self, data: DataConfig, seed: int = 0):
        """``(train, val)``: 2,048 and 512 images unless ``--synthetic-size`` says otherwise
        (``kasoku bench`` asks for a couple to read the shapes)."""
        n_train = data.synthetic_train_size or 2048
        n_val = data.synthetic_val_size or 512
        images, labels = stripes(n_train + n_val, seed)
        return (ArrayDataset(images[:n_train], labels[:n_train], name="stripes-train"),
                ArrayDataset(images[n_train:], labels[n_train:], name="stripes-val"))


def wide_stripes_cnn() -> Workload:
    """The same study with twice the channels: a function returning a workload."""
    return StripesCNN(width=32)


def stripes(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy stripe images (float32 ``[n, 1, SIZE, SIZE]``) and their labels (0:
    horizontal, 1: vertical), a pure function of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    period = torch.empty(n, 1, 1).uniform_(3, 8, generator=g)
    phase = torch.empty(n, 1, 1).uniform_(0, 2 * math.pi, generator=g)
    axis = torch.arange(SIZE, dtype=torch.float32)
    rows, cols = axis.view(1, SIZE, 1), axis.view(1, 1, SIZE)
    along = torch.where(labels.view(n, 1, 1) == 0, rows, cols)  # stripes vary along it
    waves = torch.sin(2 * math.pi * along / period + phase)
    noise = 0.5 * torch.randn(n, SIZE, SIZE, generator=g)
    return (waves + noise).unsqueeze(1), labels
