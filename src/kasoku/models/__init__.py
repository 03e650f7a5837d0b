"""kasoku's own models (no torchvision): the networks the seed workloads train.

The names below are imported on first use (PEP 562): ``gpt_shapes`` loads without torch, for
the gpt workload's settings on the command line."""
from __future__ import annotations

from kasoku.core.lazy_exports import lazy_exports

__all__ = ["MLP", "LeNet5", "SineLSTM", "ResNet", "BasicBlock", "Bottleneck",
           "resnet18", "resnet50", "resnet152"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "LeNet5": "kasoku.models.lenet5", "SineLSTM": "kasoku.models.lstm",
    "MLP": "kasoku.models.mlp",
    **dict.fromkeys(["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "resnet152"],
                    "kasoku.models.resnet")})
