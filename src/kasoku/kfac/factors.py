"""K-FAC's Kronecker factors of one batch, for ``nn.Linear`` and ``nn.Conv2d``.

For a layer ``y = W a (+ b)`` the Fisher block of ``W`` is approximated by ``A (x) G``:

- ``A = E[a a^T]``, the second moment of the layer's inputs, with a 1 appended to each input
  when the layer has a bias (the bias is the last column of the gradient matrix);
- ``G = E[d d^T]``, the second moment of the per-example gradients of the loss with respect to
  the layer's outputs. The training loss is a mean over the batch, so the output gradient
  autograd hands out is ``d / N``: it is multiplied back by ``N`` (kfac-pytorch's
  ``batch_averaged``).

A convolution is a Linear layer applied at every output position ``s`` to the patch under
the kernel (im2col, ``F.unfold``; padding, stride and dilation honored): ``A`` is averaged over
examples and positions, ``G`` averaged over examples and summed over positions (the per-example
gradient of the weight sums over them), so that ``A (x) G`` is ``S E[a a^T] (x) E[d d^T]`` over
``S`` positions, the product kfac-pytorch's factors make (Grosse & Martens 2016, KFC). Only
``groups == 1`` is supported; other convolutions are left to the base optimizer.

The factors are float32 matrices whatever the activations' dtype (the callers run outside
autocast). Their products, the bulk of K-FAC's cost, are made at ``precision``
(``FACTOR_PRECISIONS``): ``fp32`` exact float32; ``tf32`` float32 inputs on TF32 tensor cores
(10-bit mantissas, float32 sums; the default: 8x the float32 rate on an H100/H200, and plain
float32 on a CPU); ``bf16`` inputs rounded to bfloat16 (half the bytes for the patches, 8-bit
mantissas) with float32 sums (on a CPU: the same rounded inputs multiplied in float32, the same
numbers without the speed). Each entry of a factor is a mean over many products, so the
rounding of the inputs averages out to far less than the damping
(``tests/test_kfac_factors.py`` bounds it).
kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kasoku.kfac.config import FACTOR_PRECISIONS


def supported(module: nn.Module) -> bool:
    """Whether K-FAC preconditions ``module``: a Linear, or a Conv2d of one group. Subclasses
    count (kasoku's levers swap in Conv2d subclasses that compute the same convolution)."""
    if isinstance(module, nn.Conv2d):
        return module.groups == 1
    return isinstance(module, nn.Linear)


def a_factor(module: nn.Module, x: torch.Tensor, bias: bool,
             precision: str = "fp32") -> torch.Tensor:
    """``A`` of one batch from the layer's input ``x``: ``[in (+1), in (+1)]``, where ``in``
    is ``in_channels * kh * kw`` for a convolution."""
    x = _input_dtype(x.detach(), precision)
    if isinstance(module, nn.Conv2d):
        cols = _patch_columns(module, x)
    else:  # a Linear: every leading index is an example
        cols = x.reshape(-1, x.shape[-1]).t()
    return _second_moment(cols, bias, precision)


def g_factor(module: nn.Module, grad_output: torch.Tensor, precision: str = "fp32"
             ) -> torch.Tensor:
    """``G`` of one batch from the gradient of the (mean) loss with respect to the layer's
    output: ``[out, out]``."""
    g = _input_dtype(grad_output.detach(), precision)
    if isinstance(module, nn.Conv2d):
        if g.dim() == 3:  # an unbatched input
            g = g.unsqueeze(0)
        n = g.shape[0]
        # [N * S, out]: a view when the gradient is channels_last, one copy otherwise.
        rows = g.movedim(1, -1).reshape(-1, g.shape[1])
    else:  # a Linear: every leading index is an example
        rows = g.reshape(-1, g.shape[-1])
        n = rows.shape[0]
    # (1/N) sum over the N examples (and a convolution's positions) of (N g)(N g)^T
    return _gram(rows.t(), precision) * n


def _input_dtype(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` in the dtype its products are made from: bfloat16 for ``bf16``, else float32."""
    if precision not in FACTOR_PRECISIONS:
        raise ValueError(f"unknown factor precision {precision!r}; choose one of "
                         f"{', '.join(FACTOR_PRECISIONS)}")
    return x.to(torch.bfloat16) if precision == "bf16" else x.float()


def _gram(m: torch.Tensor, precision: str) -> torch.Tensor:
    """``m @ m.T`` in float32 for ``m`` of ``[k, n]``, made at ``precision``."""
    if m.dtype == torch.bfloat16:  # bf16 (_input_dtype): float32 out, float32 sums
        if m.is_cuda:
            return torch.mm(m, m.t(), out_dtype=torch.float32)
        m = m.float()
    with _tf32(precision == "tf32" and m.is_cuda):
        return m @ m.t()


@contextlib.contextmanager
def _tf32(enabled: bool):
    """TF32 tensor cores for float32 products inside the block, the previous setting after."""
    if not enabled:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _second_moment(cols: torch.Tensor, bias: bool, precision: str = "fp32") -> torch.Tensor:
    """``(1/n) sum_i c_i c_i^T`` over the ``n`` columns of ``cols`` (``[k, n]``), each with a 1
    appended when ``bias``; the ones' row and corner are written from the column sums instead
    of copying ``cols`` one row larger."""
    n = cols.shape[1]
    moment = _gram(cols, precision)
    if bias:
        sums = cols.sum(dim=1, keepdim=True, dtype=torch.float32)
        corner = sums.new_full((1, 1), float(n))
        moment = torch.cat([torch.cat([moment, sums], dim=1),
                            torch.cat([sums.t(), corner], dim=1)], dim=0)
    return moment / n


def _patch_columns(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input patches of ``conv``, one column per example and output position:
    ``[in_channels * kh * kw, N * S]``, ordered as ``conv.weight.flatten(1)``'s columns."""
    if x.dim() == 3:  # an unbatched input
        x = x.unsqueeze(0)
    pads = padding_lrtb(conv)
    if any(pads):
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, pads, mode=mode)
    patches = F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return patches.transpose(0, 1).reshape(patches.shape[1], -1)  # [N, K, S] -> [K, N * S]


def padding_lrtb(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """``conv``'s padding as ``F.pad`` takes it (left, right, top, bottom), ``"same"`` and
    ``"valid"`` included (``"same"`` puts the odd pixel on the right and bottom, as
    ``nn.Conv2d`` does)."""
    if conv.padding == "valid":
        return (0, 0, 0, 0)
    if conv.padding == "same":
        pads = []
        for d, k in zip(reversed(conv.dilation), reversed(conv.kernel_size)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    ph, pw = conv.padding
    return (pw, pw, ph, ph)
