"""ResNet-18/50/101 (He et al. 2015) with torchvision's module names, shapes and initialisation.

The v1.5 variant torchvision ships: a Bottleneck strides its 3x3 convolution,
not its first 1x1. Stem ``conv1`` (7x7, stride 2) / ``bn1`` / ``relu`` /
``maxpool``, stages ``layer1..layer4``, ``avgpool`` (adaptive, so any image of
32 px or more works) and ``fc``. A block's shortcut, where shape changes, is
``downsample = Sequential(1x1 conv, BatchNorm2d)``. Convolutions are
Kaiming-normal (fan_out, ReLU), BatchNorm weights 1 and biases 0, ``fc`` keeps
torch's default; the last BatchNorm of a residual branch is not zeroed.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "resnet101"]


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False)


def _shortcut(downsample: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """A block's identity path (computed after its branch, as torchvision does, so autograd
    hands out the gradients in the same order)."""
    return x if downsample is None else downsample(x)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (the first one strided) and the shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(c_in, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + _shortcut(self.downsample, x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided: v1.5), 1x1 expand by 4, and the shortcut (ResNet-50 and up)."""

    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(c_in, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + _shortcut(self.downsample, x))


def _stage(block, c_in: int, planes: int, n: int, stride: int) -> nn.Sequential:
    """``n`` blocks; the first one takes ``c_in`` channels, applies ``stride`` and, where the
    shape changes, gets the ``downsample`` shortcut."""
    c_out = planes * block.expansion
    downsample = None
    if stride != 1 or c_in != c_out:
        downsample = nn.Sequential(_conv1x1(c_in, c_out, stride), nn.BatchNorm2d(c_out))
    return nn.Sequential(block(c_in, planes, stride, downsample),
                         *(block(c_out, planes) for _ in range(n - 1)))


class ResNet(nn.Module):
    """The stem, four stages of ``blocks[i]`` blocks (64, 128, 256, 512 planes; stages 2-4
    halve the resolution in their first block), global average pooling and ``fc``."""

    def __init__(self, block: type[BasicBlock | Bottleneck], blocks: list[int], num_classes: int = 1000):
        super().__init__()
        e = block.expansion
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = _stage(block, 64, 64, blocks[0], stride=1)
        self.layer2 = _stage(block, 64 * e, 128, blocks[1], stride=2)
        self.layer3 = _stage(block, 128 * e, 256, blocks[2], stride=2)
        self.layer4 = _stage(block, 256 * e, 512, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * e, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: BasicBlocks 2-2-2-2, 11,689,512 parameters at 1000 classes."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: Bottlenecks 3-4-6-3, 25,557,032 parameters at 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    """ResNet-101: Bottlenecks 3-4-23-3, 44,549,160 parameters at 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes)
