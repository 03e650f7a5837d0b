"""A stride-2 convolution on few channels computed as a stride-1 convolution on four times as
many (space-to-depth): the same outputs and gradients, other cuDNN kernels.

ResNet's stem convolution (7x7, stride 2, 3 input channels) ran at ~40 TFLOP/s in ResNet-50's
step on an H200: cuDNN's kernels for 3 channels and a stride are poor, and padding the
channels to 4 or 8 did not help (research/notebook.md). Folding every 2x2 block of input pixels
into the channels turns it into a 4x4, stride-1 convolution over 12 channels (zero-padded to
16; the kernel zero-padded to 8x8, then folded the same way), the trick MLPerf's ResNet-50
submissions use.
``SpaceToDepthConv2d`` is an ``nn.Conv2d`` with the original weight, so the parameter, its
gradient and the ``state_dict`` are unchanged; only its forward differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel._recast import recast
from kasoku.accel.max_pool import MaxPool2dKernel
from kasoku.accel.notes import skip
from kasoku.core.lazy_kernel import interpreting

CHANNEL_MULTIPLE = 8
"""Folded input channels are zero-padded to a multiple of this: 12 to 16, which cuDNN runs
faster (ResNet-50's stem at batch 256 on an H200, forward + weight gradient, compiled: 1.30
ms against 1.54 with 12 channels and 2.91 unfolded; research/probes/resnet50_stem.py)."""


def foldable(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain 2-d convolution with stride 2 that folding can replace."""
    return (type(conv) in (nn.Conv2d, SpaceToDepthConv2d) and conv.stride == (2, 2)
            and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and conv.padding[0] == conv.padding[1])


class SpaceToDepthConv2d(nn.Conv2d):
    """``nn.Conv2d`` of stride 2 computed on 2x2-folded inputs (see the module's doc)."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "SpaceToDepthConv2d":
        if not foldable(conv):
            raise ValueError(f"cannot fold {conv}: needs stride 2, no dilation or groups, "
                             f"zero padding equal on both axes")
        return recast(conv, cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        k, p = self.kernel_size[0], self.padding[0]
        kb = (k + 1) // 2  # folded kernel side
        oh = (h + 2 * p - k) // 2 + 1
        ow = (w + 2 * p - self.kernel_size[1]) // 2 + 1
        hs, ws = oh + kb - 1, ow + (self.kernel_size[1] + 1) // 2 - 1
        xp = F.pad(x, (p, 2 * ws - w - p, p, 2 * hs - h - p))
        folded = xp.view(n, c, hs, 2, ws, 2).permute(0, 3, 5, 1, 2, 4).reshape(n, 4 * c, hs, ws)
        wt = self.weight
        o = wt.shape[0]
        kh, kw = 2 * kb, 2 * ((self.kernel_size[1] + 1) // 2)
        wt = F.pad(wt, (0, kw - wt.shape[3], 0, kh - wt.shape[2]))
        wt = wt.view(o, c, kb, 2, kw // 2, 2).permute(0, 3, 5, 1, 2, 4) \
            .reshape(o, 4 * c, kb, kw // 2)
        extra = -(4 * c) % CHANNEL_MULTIPLE
        if extra:
            folded = F.pad(folded, (0, 0, 0, 0, 0, extra))
            wt = F.pad(wt, (0, 0, 0, 0, 0, extra))
        if x.is_contiguous(memory_format=torch.channels_last):
            folded = folded.contiguous(memory_format=torch.channels_last)
            wt = wt.contiguous(memory_format=torch.channels_last)
        return F.conv2d(folded, wt, self.bias, 1, 0)


def apply_fast_stem(model: nn.Module, device=None, notes: list[str] | None = None
                    ) -> nn.Module:
    """Fold ``model``'s stride-2 convolutions on at most 4 input channels (a stem's)
    space-to-depth and pool its ``nn.MaxPool2d`` layers with ``kasoku.accel.max_pool``'s
    kernels, in place. Skipped with a note on devices other than CUDA (the folding was
    measured faster there only, the kernels run there only) and on models with neither kind
    of layer."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda" and not interpreting():
        skip(notes, f"fast_stem: its kernels run on CUDA devices, not {device.type}; the stem "
                    f"runs as PyTorch ops")
        return model
    changed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d and foldable(child) and child.in_channels <= 4:
                setattr(parent, name, SpaceToDepthConv2d.from_conv(child))
                changed += 1
            elif type(child) is nn.MaxPool2d:
                setattr(parent, name, MaxPool2dKernel.from_pool(child))
                changed += 1
    if not changed:
        skip(notes, f"fast_stem: {type(model).__name__} has no stride-2 convolution on <= 4 "
                    f"channels and no max-pool; nothing changed")
    return model
