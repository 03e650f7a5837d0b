"""``cifar10-resnet18``: a CIFAR-10 ResNet that trains to 90%+ in minutes on one GPU, for
time-to-accuracy comparisons of optimizers (K-FAC against SGD) that ResNet-152 makes costly."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kasoku.data.config import DataConfig
from kasoku.workloads.dataset_facts import CIFAR10_HOLDOUT_TRAIN
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    from torch import nn

SYNTHETIC_SIZES = (1280, 256)
"""Default synthetic (train, val) sizes: 10 steps per epoch at the recipe's batch of 128."""


@register_workload("cifar10-resnet18")
class Cifar10ResNet18(Workload):
    description = "ResNet-18 (CIFAR stem) on CIFAR-10, batch 128 (validated on training batch 5)"
    sample_unit = "images"
    # The usual CIFAR ResNet recipe: momentum SGD, lr 0.1 at batch 128, weight decay 5e-4,
    # cosine decay over the run.
    recipe = Recipe(optimizer="momentum", lr=0.1, momentum=0.9, weight_decay=5e-4,
                    batch_size=128, epochs=30, schedule="cosine")
    epoch_samples = CIFAR10_HOLDOUT_TRAIN

    def build_model(self) -> nn.Module:
        from kasoku.models import resnet18  # deferred: torch (workloads.registry's doc)
        return resnet18(num_classes=10, cifar_stem=True)

    def build_datasets(self, data: DataConfig, seed: int = 0):
        from kasoku.workloads.common import cifar10_holdout  # deferred: torch
        return cifar10_holdout(data, self.name, SYNTHETIC_SIZES, seed, augment=True)
