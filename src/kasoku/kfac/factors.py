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

Everything here is float32, whatever the activations' dtype, and runs outside autocast.
kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def supported(module: nn.Module) -> bool:
    """Whether K-FAC preconditions ``module``: a Linear, or a Conv2d of one group. Subclasses
    count (kasoku's levers swap in Conv2d subclasses that compute the same convolution)."""
    if isinstance(module, nn.Conv2d):
        return module.groups == 1
    return isinstance(module, nn.Linear)


def a_factor(module: nn.Module, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """``A`` of one batch from the layer's input ``x``: ``[in (+1), in (+1)]``, where ``in``
    is ``in_channels * kh * kw`` for a convolution."""
    x = x.detach().float()
    if isinstance(module, nn.Conv2d):
        cols = _patch_columns(module, x)
    else:  # a Linear: every leading index is an example
        cols = x.reshape(-1, x.shape[-1]).t()
    return _second_moment(cols, bias)


def g_factor(module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
    """``G`` of one batch from the gradient of the (mean) loss with respect to the layer's
    output: ``[out, out]``."""
    g = grad_output.detach().float()
    if isinstance(module, nn.Conv2d):
        if g.dim() == 3:  # an unbatched input
            g = g.unsqueeze(0)
        n = g.shape[0]
        rows = g.transpose(0, 1).reshape(g.shape[1], -1)  # [out, N * S]
        # (1/N) sum over examples and positions of (N g)(N g)^T
        return (rows @ rows.t()) * n
    rows = g.reshape(-1, g.shape[-1])
    n = rows.shape[0]
    return (rows.t() @ rows) * n  # (1/n) sum of (n g)(n g)^T


def _second_moment(cols: torch.Tensor, bias: bool) -> torch.Tensor:
    """``(1/n) sum_i c_i c_i^T`` over the ``n`` columns of ``cols`` (``[k, n]``), each with a 1
    appended when ``bias``; the ones' row and corner are written from the column sums instead
    of copying ``cols`` one row larger."""
    n = cols.shape[1]
    moment = cols @ cols.t()
    if bias:
        sums = cols.sum(dim=1, keepdim=True)
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
