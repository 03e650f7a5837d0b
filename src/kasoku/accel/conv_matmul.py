"""1x1 convolutions as matrix products: on a channels_last activation a 1x1 convolution is the
``[N*H*W, C_in] @ [C_in, C_out]`` product of the matrix it already is in memory, so its
forward, input gradient and weight gradient can go to cuBLAS (three GEMMs) instead of cuDNN's
convolution kernels. A stride-s 1x1 convolution is the same product on every s-th row and
column (a strided view, gathered by the product's input copy).

ResNet-50 has 36 of them among 53 convolutions (each bottleneck's reduce and expand, and the
four downsample projections). On an H200 in its compiled, graph-captured bf16 step, cuBLAS's
kernels for those shapes beat cuDNN's at small batches (research/notebook.md).

``Conv1x1Matmul`` is an ``nn.Conv2d`` with the original weight, so the parameter, its gradient
and the ``state_dict`` are unchanged; only its forward differs. Inputs that are not
channels_last take ``nn.Conv2d``'s own forward (the product would need a transpose copy).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel import wgrad_stream as _wgrad
from kasoku.accel._recast import recast
from kasoku.accel.notes import skip


def matmul_able(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain 2-d 1x1 convolution (no padding, groups or dilation; the
    same stride on both axes) that ``Conv1x1Matmul`` computes exactly."""
    return (type(conv) in (nn.Conv2d, Conv1x1Matmul) and conv.kernel_size == (1, 1)
            and conv.padding in ((0, 0), "valid") and conv.groups == 1
            and conv.dilation == (1, 1) and conv.stride[0] == conv.stride[1])


class _Subsample(torch.autograd.Function):
    """``x[:, :, ::s, ::s]`` of a channels_last ``x`` whose gradient is channels_last too
    (PyTorch's slicing backward scatters into a new NCHW tensor, which the layers before would
    copy back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: int) -> torch.Tensor:
        ctx.s, ctx.shape = s, x.shape
        return x[:, :, ::s, ::s]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, c, h, w = ctx.shape
        out = grad.new_zeros(n, h, w, c).permute(0, 3, 1, 2)  # channels_last
        out[:, :, ::ctx.s, ::ctx.s] = grad
        return out, None


class Conv1x1Matmul(nn.Conv2d):
    """``nn.Conv2d`` (1x1) computed as a matrix product on channels_last inputs (see the
    module's doc). With ``wgrad_stream`` set (by ``kasoku.accel.wgrad_stream.convert``, which
    sets it on any layer that declares the attribute) its weight gradient goes to a second
    CUDA stream."""

    wgrad_stream = False
    """Whether the weight gradient goes to ``kasoku.accel.wgrad_stream``'s second stream."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "Conv1x1Matmul":
        if not matmul_able(conv):
            raise ValueError(f"cannot compute {conv} as a matrix product: needs a 1x1 kernel, "
                             f"no padding, groups or dilation, the same stride on both axes")
        layer = recast(conv, cls)
        # A 1x1 kernel in channels_last has the same memory as a contiguous one, but other
        # strides on its size-1 axes; the product's weight gradient comes back contiguous.
        # DDP's gradient buckets copy the parameter's strides and warn (and copy) at every
        # step when the gradient's differ: give the weight the strides its gradient has.
        w = layer.weight.data
        layer.weight.data = w.as_strided(w.shape, torch.empty(w.shape, device="meta").stride())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
            return _wgrad.conv2d(self, x) if self.wgrad_stream else super().forward(x)
        s = self.stride[0]
        if s != 1:
            x = _Subsample.apply(x, s)
        n, c, h, w = x.shape
        rows = x.permute(0, 2, 3, 1).reshape(n * h * w, c)  # a view when stride is 1
        if self.wgrad_stream:
            y = _wgrad.linear(rows, self.weight, self.bias)
        else:
            y = F.linear(rows, self.weight.flatten(1), self.bias)
        return y.view(n, h, w, self.out_channels).permute(0, 3, 1, 2)  # channels_last


def apply_matmul_1x1(model: nn.Module, notes: list[str] | None = None) -> nn.Module:
    """Compute ``model``'s 1x1 convolutions as matrix products (``Conv1x1Matmul``), in place.
    Needs channels_last (``accelerate`` refuses it without); a model with no such convolution
    is left as it is, with a note."""
    changed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d and matmul_able(child):
                setattr(parent, name, Conv1x1Matmul.from_conv(child))
                changed += 1
    if not changed:
        skip(notes, f"matmul_1x1: {type(model).__name__} has no 1x1 convolution; nothing "
                    f"changed")
    return model
