"""The Triton kernels behind ``kasoku.accel.fused_bn`` (batch norm + residual + ReLU on a
channels_last activation read as the ``[M = N*H*W, C]`` matrix it is in memory), their tile
choices and launch grids. What each kernel reads and writes: ``fused_bn``'s doc.

The tile constants are module globals read at each launch, so ``research/probes/fused_bn_probe.py``
can time variants of them.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from kasoku.core.lazy_kernel import LazyKernel, interpreting

BLOCK_M = 32
"""Rows of the ``[M, C]`` activation per tile."""
PROGRAMS_PER_SM = 4
"""Reduction kernels: programs launched per multiprocessor (each sums a run of rows)."""
APPLY_ROWS = 256
"""Elementwise kernels: most rows per program (a multiple of ``BLOCK_M``)."""
APPLY_PROGRAMS_PER_SM = 8
"""Elementwise kernels: fewer rows per program (down to ``BLOCK_M``) where ``APPLY_ROWS``
would launch fewer programs than this per multiprocessor (small batches); 0: never."""
NUM_WARPS = 0
"""Warps per program; 0: 8 for layers with a residual (more loads in flight) or of up to 64
channels, else 4."""
PDL: bool | None = None
"""Launch the four kernels with programmatic dependent launch (PDL): each is scheduled while
the kernel before it drains and waits in ``gdc_wait`` for its results; the reductions let the
kernel after them start once their sums are in registers. None: on where the GPU has it
(compute capability 9.0 and later) and Triton can emit it (ResNet-50 at bs 32 on an H200:
+1%, research/notebook.md)."""
BLOCK_C = 0
"""Channels per tile; 0: 64 for layers with a residual or of up to 64 channels, else 128.
(Both chosen with research/probes/fused_bn_probe.py on an H200.)"""


def _define_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def bn_stats_kernel(X, ACC, M, C, rows_per_prog,
                     BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                     GDC: tl.constexpr = False):
        if GDC:  # programmatic dependent launch: wait for the kernel before to finish
            tl.extra.cuda.gdc_wait()
        pid_m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        first = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
        start = pid_m * rows_per_prog
        end = tl.minimum(start + rows_per_prog, M)
        acc_s = tl.full([BLOCK_M, BLOCK_C], 0.0, tl.float32)
        acc_q = tl.full([BLOCK_M, BLOCK_C], 0.0, tl.float32)
        for r0 in range(start, end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            mask = (rows < end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            v = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.where(mask, v - first[None, :], 0.0)
            acc_s += v
            acc_q += v * v
        if GDC:  # the sums are in registers: the next kernel may be scheduled (it waits)
            tl.extra.cuda.gdc_launch_dependents()
        tl.atomic_add(ACC + cols, tl.reduce(acc_s, 0, tl.standard._sum_combine), mask=cmask)
        tl.atomic_add(ACC + C + cols, tl.reduce(acc_q, 0, tl.standard._sum_combine), mask=cmask)

    @triton.jit
    def bn_forward_kernel(X, R, Y, ACC, W, B, MEAN, INVSTD, VAR, M, C, rows_per_prog, eps,
                       HAS_RES: tl.constexpr,
                       RELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                       GDC: tl.constexpr = False):
        if GDC:  # programmatic dependent launch: wait for the kernel before to finish
            tl.extra.cuda.gdc_wait()
        pid_m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        first = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
        shifted_mean = tl.load(ACC + cols, mask=cmask, other=0.0) / M
        var = tl.load(ACC + C + cols, mask=cmask, other=0.0) / M - shifted_mean * shifted_mean
        var = tl.maximum(var, 0.0)
        mean = first + shifted_mean
        invstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        scale = w * invstd
        shift = b - mean * scale
        if pid_m == 0:
            tl.store(MEAN + cols, mean, mask=cmask)
            tl.store(INVSTD + cols, invstd, mask=cmask)
            tl.store(VAR + cols, var, mask=cmask)
        start = pid_m * rows_per_prog
        end = tl.minimum(start + rows_per_prog, M)
        for r0 in range(start, end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            mask = (rows < end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            z = x * scale[None, :] + shift[None, :]
            if HAS_RES:
                z += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
            if RELU:
                z = tl.maximum(z, 0.0)
            tl.store(Y + offs, z.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def bn_backward_reduce_kernel(DY, X, Y, DR, W, B, MEAN, INVSTD, ACC, M, C, rows_per_prog,
                               HAS_RES: tl.constexpr, RELU: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                               GDC: tl.constexpr = False):
        if GDC:  # programmatic dependent launch: wait for the kernel before to finish
            tl.extra.cuda.gdc_wait()
        pid_m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mean = tl.load(MEAN + cols, mask=cmask, other=0.0)
        invstd = tl.load(INVSTD + cols, mask=cmask, other=0.0)
        scale = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) * invstd
        shift = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) - mean * scale
        start = pid_m * rows_per_prog
        end = tl.minimum(start + rows_per_prog, M)
        acc_g = tl.full([BLOCK_M, BLOCK_C], 0.0, tl.float32)
        acc_gx = tl.full([BLOCK_M, BLOCK_C], 0.0, tl.float32)
        for r0 in range(start, end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            mask = (rows < end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            if RELU:  # the ReLU's mask: the output's sign, or recomputed from x
                if HAS_RES:
                    live = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32) > 0.0
                else:
                    live = (x * scale[None, :] + shift[None, :]) > 0.0
                g = tl.where(live, g, 0.0)
            if HAS_RES:  # the residual's gradient, which the next kernel reads back
                tl.store(DR + offs, g.to(DR.dtype.element_ty), mask=mask)
            acc_g += g
            acc_gx += tl.where(mask, g * (x - mean[None, :]), 0.0)
        if GDC:  # the sums are in registers: the next kernel may be scheduled (it waits)
            tl.extra.cuda.gdc_launch_dependents()
        tl.atomic_add(ACC + cols, tl.reduce(acc_g, 0, tl.standard._sum_combine), mask=cmask)
        tl.atomic_add(ACC + C + cols, tl.reduce(acc_gx, 0, tl.standard._sum_combine), mask=cmask)

    @triton.jit
    def bn_backward_kernel(DY, X, DX, DR, W, B, MEAN, INVSTD, ACC, DW, DB, M, C,
                        rows_per_prog, HAS_RES: tl.constexpr, RELU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                        GDC: tl.constexpr = False):
        if GDC:  # programmatic dependent launch: wait for the kernel before to finish
            tl.extra.cuda.gdc_wait()
        pid_m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mean = tl.load(MEAN + cols, mask=cmask, other=0.0)
        invstd = tl.load(INVSTD + cols, mask=cmask, other=0.0)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        scale = w * invstd
        shift = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) - mean * scale
        sum_g = tl.load(ACC + cols, mask=cmask, other=0.0)
        sum_gx = tl.load(ACC + C + cols, mask=cmask, other=0.0)
        if pid_m == 0:
            tl.store(DW + cols, (sum_gx * invstd).to(DW.dtype.element_ty), mask=cmask)
            tl.store(DB + cols, sum_g.to(DB.dtype.element_ty), mask=cmask)
        # dx = w/std * (g - mean(g) - xhat * mean(g * xhat))
        mean_g = sum_g / M
        k = sum_gx * invstd * invstd / M
        start = pid_m * rows_per_prog
        end = tl.minimum(start + rows_per_prog, M)
        for r0 in range(start, end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            mask = (rows < end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:  # g, masked, as the reduction stored it
                g = tl.load(DR + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
                if RELU:
                    g = tl.where((x * scale[None, :] + shift[None, :]) > 0.0, g, 0.0)
            dx = scale[None, :] * (g - mean_g[None, :] - (x - mean[None, :]) * k[None, :])
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def bn_running_kernel(RUN_MEAN, RUN_VAR, MEAN, VAR, M, C, momentum,
                       BLOCK_C: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mean = tl.load(MEAN + cols, mask=cmask, other=0.0)
        unbiased = tl.load(VAR + cols, mask=cmask, other=0.0) * (M / (M - 1.0))
        run_mean = tl.load(RUN_MEAN + cols, mask=cmask, other=0.0).to(tl.float32)
        run_var = tl.load(RUN_VAR + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(RUN_MEAN + cols, ((1.0 - momentum) * run_mean + momentum * mean)
                 .to(RUN_MEAN.dtype.element_ty), mask=cmask)
        tl.store(RUN_VAR + cols, ((1.0 - momentum) * run_var + momentum * unbiased)
                 .to(RUN_VAR.dtype.element_ty), mask=cmask)

    return (bn_stats_kernel, bn_forward_kernel, bn_backward_reduce_kernel, bn_backward_kernel,
            bn_running_kernel)


kernels = LazyKernel(_define_kernels)
"""``kernels()``: (stats, forward, backward reduce, backward, running statistics)."""


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


@functools.lru_cache(maxsize=None)
def _has_pdl(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    import triton.language as tl
    return hasattr(tl.extra.cuda, "gdc_wait")


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of every launch of the four kernels on ``device``: programmatic
    dependent launch per ``PDL`` (never in Triton's interpreter)."""
    on = _has_pdl(device) if PDL is None else PDL
    return {"GDC": True, "launch_pdl": True} if on and not interpreting() else {}


def tiles(C: int, residual: bool) -> tuple[int, int, int]:
    """(rows per tile, channels per tile, warps per program)."""
    block_c = BLOCK_C or (64 if residual or C <= 64 else 128)
    return BLOCK_M, block_c, NUM_WARPS or (8 if residual or C <= 64 else 4)


def as_matrix(t: Tensor) -> Tensor:
    """A channels_last ``[N, C, H, W]`` tensor as the ``[N*H*W, C]`` matrix it is in memory."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w, c)


def grids(M: int, C: int, device: torch.device, block_c: int) -> tuple[tuple, tuple]:
    """((grid, rows per program) of the reduction kernels, the same of the elementwise ones)."""
    col_blocks = -(-C // block_c)
    sms = _sm_count(device)
    wanted = max(1, sms * PROGRAMS_PER_SM // col_blocks)
    reduce_rows = _round_up(-(-M // wanted), BLOCK_M)
    apply_rows = APPLY_ROWS
    if APPLY_PROGRAMS_PER_SM:
        wanted = max(1, sms * APPLY_PROGRAMS_PER_SM // col_blocks)
        apply_rows = min(APPLY_ROWS, max(BLOCK_M, _round_up(-(-M // wanted), BLOCK_M)))
    return ((-(-M // reduce_rows), col_blocks), reduce_rows), \
        ((-(-M // apply_rows), col_blocks), apply_rows)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
