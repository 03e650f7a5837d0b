"""Max pooling of channels_last activations as two Triton kernels (ResNet's 3x3/2 stem pool).

inductor's max-pool backward in ResNet-50's compiled step took 1.46 ms per step at batch 256
on an H200 (research/notebook.md), for a pass that writes 0.4 GB. Here the forward pass stores,
beside each output, the position of its maximum inside the window (one byte), and the
backward pass gives each input element the gradients of the windows whose maximum it was:
with stride S and window K an element lies in at most ceil(K/S)^2 windows, which it finds by
arithmetic, so every load and store runs along the channels, contiguous in memory.

The maximum is the first of equal values (as PyTorch's kernels), NaN wins; padding never does.
``max_pool2d(x, kernel, stride, padding)`` is a ``torch.library`` custom op with an autograd
formula, kept whole by ``torch.compile``; float16, bfloat16 and float32, CUDA (or Triton's
interpreter). ``MaxPool2dKernel`` is the ``nn.MaxPool2d`` that uses it (the ``fast_stem``
lever, ``kasoku.accel.stem.apply_fast_stem``, puts it in place).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from kasoku.accel._recast import recast
from kasoku.core.lazy_kernel import LazyKernel, interpreting

BLOCK_P = 32
"""Pixels per tile."""
BLOCK_C = 64
"""Channels per tile."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _define_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def max_pool_forward_kernel(X, Y, IDX, P, C, H, W, OH, OW, K: tl.constexpr, S: tl.constexpr,
                       PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        pmask = pix < P
        cmask = cols < C
        ow = pix % OW
        oh = (pix // OW) % OH
        n = pix // (OW * OH)
        best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
        arg = tl.full([BLOCK_P, BLOCK_C], 0, tl.int32)
        for kh in tl.static_range(K):
            h = oh * S - PAD + kh
            for kw in tl.static_range(K):
                w = ow * S - PAD + kw
                inside = pmask & (h >= 0) & (h < H) & (w >= 0) & (w < W)
                row = ((n.to(tl.int64) * H + h) * W + w) * C
                mask = inside[:, None] & cmask[None, :]
                v = tl.load(X + row[:, None] + cols[None, :], mask=mask,
                            other=float("-inf")).to(tl.float32)
                take = mask & ((v > best) | (v != v))
                best = tl.where(take, v, best)
                arg = tl.where(take, kh * K + kw, arg)
        out = pix.to(tl.int64)[:, None] * C + cols[None, :]
        omask = pmask[:, None] & cmask[None, :]
        tl.store(Y + out, best.to(Y.dtype.element_ty), mask=omask)
        tl.store(IDX + out, arg.to(tl.int8), mask=omask)

    @triton.jit
    def max_pool_backward_kernel(DY, IDX, DX, P, C, H, W, OH, OW, K: tl.constexpr, S: tl.constexpr,
                        PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        pmask = pix < P
        cmask = cols < C
        w = pix % W
        h = (pix // W) % H
        n = pix // (W * H)
        # Windows oh with oh*S - PAD <= h <= oh*S - PAD + K - 1: from the first at or above
        # (h + PAD - K + 1) / S, at most ceil(K / S) of them.
        oh0 = tl.maximum(h + PAD - K + S, 0) // S
        ow0 = tl.maximum(w + PAD - K + S, 0) // S
        acc = tl.full([BLOCK_P, BLOCK_C], 0.0, tl.float32)
        for dh in tl.static_range((K + S - 1) // S):
            oh = oh0 + dh
            kh = h + PAD - oh * S
            for dw in tl.static_range((K + S - 1) // S):
                ow = ow0 + dw
                kw = w + PAD - ow * S
                hit = pmask & (oh < OH) & (ow < OW) & (kh >= 0) & (kh < K) & (kw >= 0) \
                    & (kw < K)
                at = ((n.to(tl.int64) * OH + oh) * OW + ow) * C
                mask = hit[:, None] & cmask[None, :]
                offs = at[:, None] + cols[None, :]
                idx = tl.load(IDX + offs, mask=mask, other=-1).to(tl.int32)
                g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
                acc += tl.where(idx == (kh * K + kw)[:, None], g, 0.0)
        out = pix.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(DX + out, acc.to(DX.dtype.element_ty), mask=pmask[:, None] & cmask[None, :])

    return max_pool_forward_kernel, max_pool_backward_kernel


_kernels = LazyKernel(_define_kernels)


def _out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _grid(pixels: int, C: int) -> tuple:
    return (-(-pixels // BLOCK_P), -(-C // BLOCK_C))


@torch.library.custom_op("kasoku::max_pool2d_nhwc", mutates_args=())
def _max_pool_forward(x: Tensor, kernel: int, stride: int, padding: int
                      ) -> tuple[Tensor, Tensor]:
    x = x.contiguous(memory_format=torch.channels_last)
    n, C, H, W = x.shape
    OH, OW = _out_size(H, kernel, stride, padding), _out_size(W, kernel, stride, padding)
    y = torch.empty((n, C, OH, OW), dtype=x.dtype, device=x.device,
                    memory_format=torch.channels_last)
    idx = torch.empty((n, C, OH, OW), dtype=torch.int8, device=x.device,
                      memory_format=torch.channels_last)
    P = n * OH * OW
    if P and C:
        _kernels()[0][_grid(P, C)](x, y, idx, P, C, H, W, OH, OW, K=kernel, S=stride,
                                   PAD=padding, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C)
    return y, idx


@_max_pool_forward.register_fake
def _(x, kernel, stride, padding):
    n, C, H, W = x.shape
    shape = (n, C, _out_size(H, kernel, stride, padding), _out_size(W, kernel, stride, padding))
    return (x.new_empty(shape).contiguous(memory_format=torch.channels_last),
            x.new_empty(shape, dtype=torch.int8).contiguous(memory_format=torch.channels_last))


@torch.library.custom_op("kasoku::max_pool2d_nhwc_backward", mutates_args=())
def _max_pool_backward(dy: Tensor, idx: Tensor, height: int, width: int, kernel: int,
                       stride: int, padding: int) -> Tensor:
    dy = dy.contiguous(memory_format=torch.channels_last)
    n, C, OH, OW = dy.shape
    dx = torch.empty((n, C, height, width), dtype=dy.dtype, device=dy.device,
                     memory_format=torch.channels_last)
    P = n * height * width
    if P and C:
        _kernels()[1][_grid(P, C)](dy, idx, dx, P, C, height, width, OH, OW, K=kernel,
                                   S=stride, PAD=padding, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C)
    return dx


@_max_pool_backward.register_fake
def _(dy, idx, height, width, kernel, stride, padding):
    n, C = dy.shape[:2]
    return dy.new_empty((n, C, height, width)).contiguous(memory_format=torch.channels_last)


def _setup_context(ctx, inputs, output):
    x, kernel, stride, padding = inputs
    ctx.geometry = (x.shape[2], x.shape[3], kernel, stride, padding)
    ctx.save_for_backward(output[1])


def _backward(ctx, dy, _didx):
    (idx,) = ctx.saved_tensors
    return _max_pool_backward(dy, idx, *ctx.geometry), None, None, None


_max_pool_forward.register_autograd(_backward, setup_context=_setup_context)


def max_pool2d(x: Tensor, kernel: int, stride: int, padding: int) -> Tensor:
    """``F.max_pool2d(x, kernel, stride, padding)`` of a 4-d tensor, channels_last out."""
    if not 0 <= padding <= kernel // 2:
        raise ValueError(f"padding must be between 0 and kernel // 2, got {padding} for "
                         f"kernel {kernel}")
    return _max_pool_forward(x, kernel, stride, padding)[0]


class MaxPool2dKernel(nn.MaxPool2d):
    """``nn.MaxPool2d`` that pools channels_last CUDA tensors with the kernels (the same
    result); other inputs, and settings the kernels lack, take PyTorch's pooling."""

    @classmethod
    def from_pool(cls, pool: nn.MaxPool2d) -> "MaxPool2dKernel":
        return recast(pool, cls)

    def forward(self, x: Tensor) -> Tensor:
        geometry = _square(self.kernel_size, self.stride, self.padding)
        if (geometry is not None and self.dilation in (1, (1, 1)) and not self.ceil_mode
                and not self.return_indices and x.dim() == 4 and x.dtype in DTYPES
                and (x.is_cuda or interpreting())
                and x.is_contiguous(memory_format=torch.channels_last)):
            return max_pool2d(x, *geometry)
        return super().forward(x)


def _square(kernel, stride, padding) -> tuple[int, int, int] | None:
    """(kernel, stride, padding) when each is the same on both axes and the kernels can pool
    with them, else None."""
    values = []
    for v in (kernel, stride if stride is not None else kernel, padding):
        if isinstance(v, (tuple, list)):
            if len(v) != 2 or v[0] != v[1]:
                return None
            v = v[0]
        values.append(int(v))
    k, s, p = values
    return (k, s, p) if s >= 1 and 0 <= p <= k // 2 else None
