"""kasoku's own models (no torchvision): the networks the seed workloads train."""
from kasoku.models.lenet5 import LeNet5
from kasoku.models.lstm import SineLSTM
from kasoku.models.mlp import MLP
from kasoku.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50, resnet152

__all__ = ["MLP", "LeNet5", "SineLSTM", "ResNet", "BasicBlock", "Bottleneck",
           "resnet18", "resnet50", "resnet152"]
