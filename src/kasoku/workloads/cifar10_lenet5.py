"""``cifar10-lenet5``: seed 001's CNN study, LeNet5 with sigmoids on CIFAR-10 (~60% val. acc.
in 50 epochs)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kasoku.data.config import DataConfig
from kasoku.workloads.dataset_facts import CIFAR10_HOLDOUT_TRAIN
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    from torch import nn

SYNTHETIC_SIZES = (10000, 1000)
"""Default synthetic (train, val) sizes."""


@register_workload("cifar10-lenet5")
class Cifar10LeNet5(Workload):
    description = ("LeNet5 (sigmoid, conv 6/16/120, fc 84/10) on CIFAR-10 (validated on "
                   "training batch 5)")
    sample_unit = "images"
    # Seed 001 trains LeNet5 with the same Chainer trainer script as its MNIST run: Adam
    # (alpha 1e-3), minibatch 100, 50 epochs, no augmentation.
    recipe = Recipe(optimizer="adam", lr=1e-3, batch_size=100, epochs=50)
    epoch_samples = CIFAR10_HOLDOUT_TRAIN

    def build_model(self) -> nn.Module:
        from kasoku.models import LeNet5  # deferred: torch (workloads.registry's doc)
        return LeNet5(in_channels=3, num_classes=10)

    def build_datasets(self, data: DataConfig, seed: int = 0):
        from kasoku.workloads.common import cifar10_holdout  # deferred: torch
        return cifar10_holdout(data, self.name, SYNTHETIC_SIZES, seed, augment=False)
