"""gpu-jpeg's crop, resize, flip and normalize as one Triton kernel.

``gpu_jpeg.crop_resize_normalize`` does this work with PyTorch ops: per bilinear tap an
int64 index tensor the size of the output and a gather, then three lerps and the
normalization, each a full pass over a ``[B, 3, S, S]`` tensor. At batch 256 and S = 224 that
is about 5 GB of memory traffic per batch, on the GPU the training step runs on: beside
ResNet-50's compiled, graphed step on an H200, the whole loader batch (decode, then crop)
left the step 93% of its rate where the decode alone left it 99%
(``research/probes/decode_interference.py --compile 1 --decoders torchvision,kasoku-tv``).

Here one program makes one output row of one image, its three channels: it computes the
row's and the columns' taps from the image's crop box, gathers the four neighbours of each
pixel and writes the normalized float32 value, so the output (0.15 GB at batch 256) is the
only full-size traffic. The decoded images are not concatenated first either: as in
``kasoku.accel.triton_adam``, the kernel takes one image as the base pointer and every
image's distance from it in bytes, so the images stay where the decoder put them.

The arithmetic is ``crop_resize_normalize``'s, in the same order, so the two agree to float32
rounding (the tests hold them to it). With ``TRITON_INTERPRET=1`` Triton runs the kernel on
the CPU (slowly: for tests).
"""
from __future__ import annotations

import os
import threading

import torch

from kasoku.core.lazy_kernel import LazyKernel, interpreting

ENV = "KASOKU_CROP_KERNEL"
"""``torch`` makes gpu-jpeg crop with PyTorch ops instead of the kernel (for comparisons)."""

TABLE_COLUMNS = 12
"""Per image (float64): distance from the base in bytes, H, W, strides (row, column,
channel) in elements, crop box (top, left, height, width), flip, label."""

_LAUNCHING = threading.Lock()


def usable(device: torch.device) -> bool:
    """Whether the kernel can crop on ``device``: CUDA (or the interpreter on the CPU), Triton
    installed, and not switched off by ``KASOKU_CROP_KERNEL=torch``."""
    if os.environ.get(ENV, "") == "torch":
        return False
    if torch.device(device).type != "cuda" and not interpreting():
        return False
    try:
        import triton  # noqa: F401 - only whether it is there
    except ImportError:
        return False
    return True


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def crop_kernel(base, table, norm, out, S: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // S
        i = pid % S
        row_at = table + b * 12
        offset = tl.load(row_at).to(tl.int64)
        height = tl.load(row_at + 1).to(tl.int64)
        width = tl.load(row_at + 2).to(tl.int64)
        row_stride = tl.load(row_at + 3).to(tl.int64)
        col_stride = tl.load(row_at + 4).to(tl.int64)
        chan_stride = tl.load(row_at + 5).to(tl.int64)
        top = tl.load(row_at + 6).to(tl.float32)
        left = tl.load(row_at + 7).to(tl.float32)
        box_h = tl.load(row_at + 8).to(tl.float32)
        box_w = tl.load(row_at + 9).to(tl.float32)
        flip = tl.load(row_at + 10) > 0

        # This row's two source rows and weight.
        y = top + (i + 0.5) * (box_h / S) - 0.5
        y = tl.maximum(y, 0.0)
        y_lo = tl.floor(y)
        wy = y - y_lo
        y0 = tl.minimum(y_lo.to(tl.int64), height - 1)
        y1 = tl.minimum(y0 + 1, height - 1)

        # Every column's two source columns and weight (mirrored centres where flipped).
        j = tl.arange(0, BLOCK)
        inside = j < S
        centre = j.to(tl.float32) + 0.5
        centre = tl.where(flip, S - centre, centre)
        x = left + centre * (box_w / S) - 0.5
        x = tl.maximum(x, 0.0)
        x_lo = tl.floor(x)
        wx = x - x_lo
        x0 = tl.minimum(x_lo.to(tl.int64), width - 1)
        x1 = tl.minimum(x0 + 1, width - 1)
        c0 = x0 * col_stride
        c1 = x1 * col_stride

        for c in tl.static_range(3):
            start = offset + c * chan_stride
            r0 = start + y0 * row_stride
            r1 = start + y1 * row_stride
            p00 = tl.load(base + r0 + c0, mask=inside, other=0).to(tl.float32)
            p01 = tl.load(base + r0 + c1, mask=inside, other=0).to(tl.float32)
            p10 = tl.load(base + r1 + c0, mask=inside, other=0).to(tl.float32)
            p11 = tl.load(base + r1 + c1, mask=inside, other=0).to(tl.float32)
            # torch.lerp(a, b, w)'s formula (exact at both ends), three times.
            upper = tl.where(wx < 0.5, p00 + wx * (p01 - p00), p01 - (p01 - p00) * (1.0 - wx))
            lower = tl.where(wx < 0.5, p10 + wx * (p11 - p10), p11 - (p11 - p10) * (1.0 - wx))
            value = tl.where(wy < 0.5, upper + wy * (lower - upper),
                             lower - (lower - upper) * (1.0 - wy))
            shift = tl.load(norm + c)
            scale = tl.load(norm + 3 + c)
            tl.store(out + ((b * 3 + c) * S + i) * S + j, shift + value * scale, mask=inside)

    return crop_kernel


_kernel = LazyKernel(_define_kernel)


def crop_resize_normalize_kernel(base: torch.Tensor, table: torch.Tensor, size: int,
                                 mean, std) -> torch.Tensor:
    """``crop_resize_normalize`` of the images ``table`` describes (``TABLE_COLUMNS``, one
    row per image; column 0: the image's distance from ``base``, a uint8 tensor on the same
    device, in bytes), as float32 ``[B, 3, size, size]``, on the current stream."""
    if base.dtype != torch.uint8:
        raise TypeError(f"images must be uint8, got {base.dtype}")
    if table.dtype != torch.float64 or table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(f"table must be float64 [B, {TABLE_COLUMNS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    n, device = table.shape[0], base.device
    norm = _norm(device, tuple(mean), tuple(std))
    out = torch.empty(n, 3, size, size, dtype=torch.float32, device=device)
    if n:
        block = 1 << (size - 1).bit_length()
        kernel = _kernel()
        # One launch at a time: gpu-jpeg's decoding threads share the kernel, and Triton's
        # first call compiles it (not thread-safe; its interpreter is not either).
        with _LAUNCHING:
            kernel[(n * size,)](base, table, norm, out, S=size, BLOCK=block, num_warps=4)
    return out


_NORMS: dict = {}


def _norm(device: torch.device, mean: tuple, std: tuple) -> torch.Tensor:
    """``crop_resize_normalize``'s ``addcmul(-m / s, x, 1 / (255 s))`` constants, the same
    float32 values: shifts then scales, on ``device`` (made once)."""
    key = (device, mean, std)
    norm = _NORMS.get(key)
    if norm is None:
        m = torch.tensor(mean, dtype=torch.float32)
        s = torch.tensor(std, dtype=torch.float32)
        norm = _NORMS[key] = torch.cat([-m / s, 1.0 / (255.0 * s)]).to(device)
    return norm
