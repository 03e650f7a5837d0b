"""``imagenet-resnet50``: the images/s ladder of seeds 000 and 004 (ResNet-50 v1.5 on an
ImageNet-style JPEG folder of any resolution)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.workloads.dataset_facts import require_root
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    from torch import nn

IMAGE_SIZE = 224
NUM_CLASSES = 1000
SYNTHETIC_SIZES = (2560, 256)
"""Default synthetic (train, val) sizes: 10 steps per epoch at the recipe's batch of 256."""


@register_workload("imagenet-resnet50")
class ImagenetResNet50(Workload):
    description = "ResNet-50 v1.5 on an ImageNet-style JPEG folder, 224x224, 1000 classes"
    sample_unit = "images"
    # The standard recipe (Goyal et al. 2017): momentum SGD, lr 0.1 per 256 samples, weight
    # decay 1e-4, 90 epochs, 5 warmup epochs; cosine decay instead of steps at 30/60/80 (same
    # accuracy, one fewer knob).
    recipe = Recipe(optimizer="momentum", lr=0.1, momentum=0.9, weight_decay=1e-4,
                    batch_size=256, epochs=90, schedule="cosine", warmup_epochs=5)
    epoch_samples = 1_281_167
    """ImageNet-1k's training set."""

    def build_model(self) -> nn.Module:
        from kasoku.models import resnet50  # deferred: torch (workloads.registry's doc)
        return resnet50(num_classes=NUM_CLASSES)

    def build_datasets(self, data: DataConfig, seed: int = 0):
        """``(train, val)``; ``val`` is None when the folder has no validation split."""
        from kasoku.data.imagefolder import imagefolder_datasets  # deferred: torch
        from kasoku.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ToUnitFloat  # deferred
        from kasoku.workloads.common import synthetic_image_datasets  # deferred: torch
        if data.synthetic:
            return synthetic_image_datasets(data, (3, IMAGE_SIZE, IMAGE_SIZE), NUM_CLASSES,
                                            SYNTHETIC_SIZES,
                                            ToUnitFloat(IMAGENET_MEAN, IMAGENET_STD),
                                            seed=seed, name="synthetic-imagenet")
        root = require_root(
            data, self.name,
            "an ImageNet-style image folder: DIR/<class>/<image>.jpg, one folder per class "
            "(or DIR/train/<class>/... with an optional DIR/val/<class>/... for validation)",
            "ImageNet itself cannot be downloaded automatically (image-net.org requires "
            "registration); `kasoku data make-jpeg DIR` writes a synthetic JPEG folder of that "
            f"layout (add {flag('make_jpeg.resolution')} WxH to match a resolution study).")
        return imagefolder_datasets(root, image_size=IMAGE_SIZE, seed=seed, strict=data.strict)
