"""Seed 004's fused BN+ReLU: training-mode batch norm, the residual add and the ReLU of a
channels_last layer as two Triton kernels forward and two backward, one custom op each way.

Why: in ResNet-50's compiled, graphed step on an H200 more than half the time (21 of 38 ms at
batch 256) went to inductor's kernels for batch norm, ReLU and the residual adds, at about half
the GPU's copy rate (research/notebook.md). Here a channels_last activation ``[N, C, H, W]`` is
read as the matrix ``[M = N*H*W, C]`` it is in memory, and each layer makes these passes:

forward   statistics: read x; per channel, sums of ``x - x[0]`` and of its square (shifted
          sums: no cancellation when the mean is large against the spread), accumulated with
          atomics into a zeroed ``[2, C]`` float32 buffer;
          apply: read x (and the residual), write ``y = relu(x * scale + shift (+ r))``; the
          first block of rows also stores the batch mean, 1/std (for the backward pass) and
          variance, from which a small kernel updates the running statistics, as
          ``nn.BatchNorm2d`` does (unbiased variance);
backward  reduce: read dy and x (and y, whose sign is the ReLU's mask, when there is a
          residual; without one the mask is recomputed from x); per channel sums of the masked
          gradient g and of ``g * (x - mean)``; with a residual, write g (its gradient);
          apply: read dy and x again (with a residual: g and x), write dx; the first block of
          rows stores the weight's and bias's gradients.

Measured on an H200 (ResNet-50's 53 layers, bf16, forward + backward, each layer in a CUDA
graph; ``research/probes/fused_bn_probe.py``): 15.7 ms against 17.4 ms for inductor's kernels of
the same PyTorch ops at batch 256, at 2.4-4.1 TB/s of least traffic per layer; 3.05 against
3.15 ms at batch 32. In the whole compiled, graphed training step the lever alone took
ResNet-50 from 6,789 to 7,117 images/s at batch 256 (research/notebook.md).

The kernels, their tiles and grids are in ``kasoku.accel.bn_kernels``. Both ops are
``torch.library`` custom ops with an autograd formula, so ``torch.compile`` and a
captured CUDA graph keep them whole (inductor calls them as it calls cuDNN). Which layers: the
models' ``kasoku.models.norm.BatchNormAct2d`` (batch norm, optional residual, optional ReLU in
one module); ``apply_fused_bn`` recasts them as ``FusedBatchNormAct2d``, which takes this path.
It runs when the layer is training with running statistics and a momentum, on a CUDA (or,
with ``TRITON_INTERPRET=1``, CPU) tensor in channels_last of float16, bfloat16 or float32 of
at least ``MIN_ELEMENTS`` elements; anywhere else the module computes the same thing with
PyTorch ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from kasoku.accel._recast import recast
from kasoku.accel.bn_kernels import as_matrix, grids, kernels, launch_options, tiles
from kasoku.accel.notes import skip
from kasoku.core.lazy_kernel import interpreting
from kasoku.models.norm import BatchNormAct2d

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_ELEMENTS = 1 << 21
"""Smaller activations keep PyTorch's ops: there inductor's kernels (fewer launches per
layer) were faster than these on an H200 (ResNet-50's 256x14x14 and 512x7x7 layers at batch
32: 22.4 and 17.2 us against 30.6 and 24.5 us forward + backward;
research/probes/fused_bn_probe.py).
From 2**21 elements up the fused kernels were as fast or faster."""

def _channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("kasoku::bn_act_forward", mutates_args=())
def bn_act_forward(x: Tensor, weight: Tensor, bias: Tensor, residual: Optional[Tensor],
                   eps: float, relu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, mean, 1/std, variance)``: ``y = [relu](batch_norm(x) [+ residual])`` in training
    mode, with the batch's statistics (variance biased, as the normalization uses it)."""
    x = _channels_last(x)
    n, C, h, w = x.shape
    M = n * h * w
    y = torch.empty_like(x)
    mean = torch.empty(C, dtype=torch.float32, device=x.device)
    invstd, var = torch.empty_like(mean), torch.empty_like(mean)
    acc = torch.zeros(2, C, dtype=torch.float32, device=x.device)
    res = _channels_last(residual) if residual is not None else x
    stats, forward = kernels()[:2]
    pdl = launch_options(x.device)
    block_m, block_c, warps = tiles(C, residual is not None)
    (red_grid, red_rows), (app_grid, app_rows) = grids(M, C, x.device, block_c)
    xm = as_matrix(x)
    stats[red_grid](xm, acc, M, C, red_rows, BLOCK_M=block_m, BLOCK_C=block_c,
                    num_warps=warps, **pdl)
    forward[app_grid](xm, as_matrix(res), as_matrix(y), acc, weight, bias, mean, invstd, var,
                      M, C, app_rows, eps, HAS_RES=residual is not None, RELU=relu,
                      BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps, **pdl)
    return y, mean, invstd, var


@bn_act_forward.register_fake
def _(x, weight, bias, residual, eps, relu):
    C = x.shape[1]
    y = torch.empty_like(x, memory_format=torch.channels_last)
    stat = x.new_empty(C, dtype=torch.float32)
    return y, stat, torch.empty_like(stat), torch.empty_like(stat)


@torch.library.custom_op("kasoku::bn_running_stats_",
                         mutates_args=("running_mean", "running_var"))
def bn_running_stats_(running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor,
                      count: int, momentum: float) -> None:
    """``running = (1 - momentum) * running + momentum * batch``, the variance unbiased over
    ``count`` values per channel (``nn.BatchNorm2d``'s update), in place."""
    C = mean.numel()
    running = kernels()[4]
    running[(-(-C // 128),)](running_mean, running_var, mean, var, count, C, momentum,
                             BLOCK_C=128)


@bn_running_stats_.register_fake
def _(running_mean, running_var, mean, var, count, momentum):
    return None


@torch.library.custom_op("kasoku::bn_act_backward", mutates_args=())
def bn_act_backward(dy: Tensor, x: Tensor, y: Tensor, weight: Tensor, bias: Tensor,
                    mean: Tensor, invstd: Tensor, has_residual: bool,
                    relu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dresidual)`` of ``bn_act_forward`` (``dresidual`` is empty
    without a residual). ``y`` is the forward output, read only with a residual and ReLU."""
    dy, x, y = _channels_last(dy), _channels_last(x), _channels_last(y)
    n, C, h, w = x.shape
    M = n * h * w
    dx = torch.empty_like(x)
    dr = torch.empty_like(x) if has_residual else x.new_empty(0)
    dweight = torch.empty_like(weight)
    dbias = torch.empty_like(bias)
    acc = torch.zeros(2, C, dtype=torch.float32, device=x.device)
    reduce, backward = kernels()[2:4]
    pdl = launch_options(x.device)
    block_m, block_c, warps = tiles(C, has_residual)
    (red_grid, red_rows), (app_grid, app_rows) = grids(M, C, x.device, block_c)
    dym, xm, ym = as_matrix(dy), as_matrix(x), as_matrix(y)
    drm = as_matrix(dr) if has_residual else dym
    reduce[red_grid](dym, xm, ym, drm, weight, bias, mean, invstd, acc, M, C, red_rows,
                     HAS_RES=has_residual, RELU=relu, BLOCK_M=block_m, BLOCK_C=block_c,
                     num_warps=warps, **pdl)
    backward[app_grid](dym, xm, as_matrix(dx), drm, weight, bias, mean, invstd, acc, dweight,
                       dbias, M, C, app_rows,
                       HAS_RES=has_residual, RELU=relu, BLOCK_M=block_m, BLOCK_C=block_c,
                       num_warps=warps, **pdl)
    return dx, dweight, dbias, dr


@bn_act_backward.register_fake
def _(dy, x, y, weight, bias, mean, invstd, has_residual, relu):
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    dr = torch.empty_like(x, memory_format=torch.channels_last) if has_residual \
        else x.new_empty(0)
    return dx, torch.empty_like(weight), torch.empty_like(bias), dr


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _, relu = inputs
    y, mean, invstd, _ = output
    ctx.has_residual, ctx.relu = residual is not None, relu
    # The output is read back only for the ReLU's mask behind a residual add.
    ctx.save_for_backward(x, y if (relu and residual is not None) else x, weight, bias, mean,
                          invstd)


def _backward(ctx, dy, _dmean, _dinvstd, _dvar):
    x, y, weight, bias, mean, invstd = ctx.saved_tensors
    dx, dweight, dbias, dr = bn_act_backward(dy, x, y, weight, bias, mean, invstd,
                                             ctx.has_residual, ctx.relu)
    return dx, dweight, dbias, (dr if ctx.has_residual else None), None, None


bn_act_forward.register_autograd(_backward, setup_context=_setup_context)


def fusable(module: nn.BatchNorm2d, x: Tensor, residual: Tensor | None) -> bool:
    """Whether the kernels can run this call (else the module's PyTorch ops do)."""
    return (module.training and module.track_running_stats and module.affine
            and module.momentum is not None and x.dim() == 4
            and (x.is_cuda or interpreting()) and x.dtype in DTYPES
            and x.is_contiguous(memory_format=torch.channels_last)
            and x.shape[0] * x.shape[2] * x.shape[3] > 1 and x.numel() >= MIN_ELEMENTS
            and (residual is None or residual.shape == x.shape))


class FusedBatchNormAct2d(BatchNormAct2d):
    """``BatchNormAct2d`` whose forward runs the kernels where they can take the call
    (``fusable``) and the module's PyTorch ops elsewhere. Made from a ``BatchNormAct2d`` by
    ``recast``: the same parameters, buffers and ``state_dict``."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if not fusable(self, x, residual):
            return super().forward(x, residual)
        y, mean, _, var = bn_act_forward(x, self.weight, self.bias, residual,
                                         float(self.eps), self.relu)
        with torch.no_grad():
            bn_running_stats_(self.running_mean, self.running_var, mean, var,
                              x.shape[0] * x.shape[2] * x.shape[3], float(self.momentum))
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
        return y


def apply_fused_bn(model: nn.Module, device=None, notes: list[str] | None = None
                   ) -> nn.Module:
    """Route every ``BatchNormAct2d`` of ``model`` through the fused kernels, in place
    (``FusedBatchNormAct2d``: the same parameters and ``state_dict``); skipped with a note where
    they cannot run (no CUDA device, no Triton, no such layers). The kernels read channels_last
    activations: ``accelerate`` refuses the lever without channels_last."""
    layers = [(parent, name, child) for parent in list(model.modules())
              for name, child in parent.named_children() if type(child) is BatchNormAct2d]
    device = torch.device(device) if device is not None else None
    reason = None
    if not layers:
        reason = f"{type(model).__name__} has no BatchNormAct2d layer"
    elif device is not None and device.type != "cuda" and not interpreting():
        reason = f"the kernels run on CUDA devices, not {device.type}"
    else:
        try:
            import triton  # noqa: F401 - only whether it is there
        except ImportError:
            reason = "Triton is not installed (torch's CUDA builds ship it)"
    if reason is not None:
        skip(notes, f"fused_bn: {reason}; batch norm runs as PyTorch ops")
        return model
    for parent, name, child in layers:
        setattr(parent, name, recast(child, FusedBatchNormAct2d))
    return model
