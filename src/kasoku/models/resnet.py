"""ResNet (He et al. 2015) written for kasoku, no torchvision.

* ``Bottleneck`` is v1.5: the stride sits on the 3x3 convolution, not the first 1x1 (the
  variant NVIDIA's and MLPerf's ResNet-50 use, and torchvision's; ~0.5% better top-1 than v1).
* Two stems: ImageNet (conv7x7/2 + BN + ReLU + maxpool3/2, for 224x224) and CIFAR (conv3x3/1
  + BN + ReLU, no pooling, for 32x32: the 7x7/2 stem plus pooling would leave 8x8 maps after it).
* Init: Kaiming-normal (fan_out, ReLU) convolutions, BN weight 1 / bias 0, and with
  ``zero_init_residual`` the last BN of every residual branch starts at gamma 0, so each block
  starts as the identity (Goyal et al. 2017: helps large-batch training with warmup).

``resnet50(1000)`` has 25,557,032 parameters and ``ResNet(Bottleneck, [3, 8, 36, 3], 1000)``
60,192,808, the same as torchvision's models of those names.
"""
from __future__ import annotations

import torch
from torch import nn

from kasoku.models.norm import BatchNormAct2d


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34). Output channels = ``planes``."""
    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(in_ch, planes, stride)
        self.bn1 = BatchNormAct2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = BatchNormAct2d(planes)  # + identity, then ReLU
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn1(self.conv1(x))
        return self.bn2(self.conv2(out), identity)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride: v1.5) -> 1x1 expand to ``planes * 4``."""
    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = _conv1x1(in_ch, planes)
        self.bn1 = BatchNormAct2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = BatchNormAct2d(planes)
        self.conv3 = _conv1x1(planes, out_ch)
        self.bn3 = BatchNormAct2d(out_ch)  # + identity, then ReLU
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn1(self.conv1(x))
        out = self.bn2(self.conv2(out))
        return self.bn3(self.conv3(out), identity)


class ResNet(nn.Module):
    """``block`` repeated ``layers[i]`` times in four stages of 64/128/256/512 planes (stages
    2-4 halve the resolution in their first block), global average pooling, a linear
    classifier. Fully convolutional up to the pooling, so any input size of at least 32x32
    (ImageNet stem) or 8x8 (CIFAR stem) works."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int],
                 num_classes: int = 1000, cifar_stem: bool = False,
                 zero_init_residual: bool = True, in_channels: int = 3):
        super().__init__()
        if len(layers) != 4:
            raise ValueError(f"ResNet takes four stage depths, got {layers}")
        if cifar_stem:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False),
                BatchNormAct2d(64))
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
                BatchNormAct2d(64), nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self._in_ch = 64
        self.layer1 = self._make_stage(block, 64, layers[0], stride=1)
        self.layer2 = self._make_stage(block, 128, layers[1], stride=2)
        self.layer3 = self._make_stage(block, 256, layers[2], stride=2)
        self.layer4 = self._make_stage(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self._init_weights(zero_init_residual)

    def _make_stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        out_ch = planes * block.expansion
        downsample = None
        if stride != 1 or self._in_ch != out_ch:
            downsample = nn.Sequential(_conv1x1(self._in_ch, out_ch, stride),
                                       BatchNormAct2d(out_ch, relu=False))
        stage = [block(self._in_ch, planes, stride, downsample)]
        self._in_ch = out_ch
        stage += [block(out_ch, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, cifar_stem: bool = True, **kwargs) -> ResNet:
    """ResNet-18 (stages 2/2/2/2 of basic blocks); defaults to CIFAR-10 (3x3 stem, 10 classes),
    where it trains to 90%+ in minutes on one GPU."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, cifar_stem=cifar_stem, **kwargs)


def resnet50(num_classes: int = 1000, cifar_stem: bool = False, **kwargs) -> ResNet:
    """ResNet-50 v1.5 (stages 3/4/6/3 of bottlenecks)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, cifar_stem=cifar_stem, **kwargs)


def resnet152(num_classes: int = 10, cifar_stem: bool = True, **kwargs) -> ResNet:
    """ResNet-152 v1.5 (stages 3/8/36/3 of bottlenecks); defaults to seed 001's CIFAR-10 use."""
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes, cifar_stem=cifar_stem, **kwargs)
