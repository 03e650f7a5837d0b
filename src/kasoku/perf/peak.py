"""This device's matrix-product peak for a dtype, measured (MFU's denominator), and its memory
bandwidth, measured (the limit of a memory-bound kernel: ``measure_bandwidth``).

GPU: square ``size``-cubed products (8192 by default, large enough to reach the tensor cores'
plateau on an H200), timed with CUDA events around a run of back-to-back products, the median
of ``reps`` runs. CPU: a smaller product (2048 by default) timed with ``perf_counter``, on the
threads PyTorch is set to use, so the peak matches what the benchmark's operators get.

The bandwidth is a copy of one tensor into another, each far larger than the last-level cache
(1 GiB on a GPU, 256 MiB on a CPU), read once and written once: the bytes of both over the
copy's time, timed as the products are. A copy is the rate every memory-bound kernel meets at
best (STREAM's "copy"; the datasheet's figure counts what no kernel reaches).

Each dtype is measured in a state that touches no other: ``tf32`` turns TF32 on for the fp32
product and restores the previous setting; ``fp32`` forces it off.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kasoku.perf.noise import spread
from kasoku.perf.sysinfo import cpu_name

PEAK_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
               "fp16": torch.float16}
DEFAULT_SIZE = {"cuda": 8192, "cpu": 2048}
TARGET_RUN_S = {"cuda": 0.02, "cpu": 0.05}
"""Each timed run repeats the product until it lasts about this long."""
WARM_S = {"cuda": 0.5}
"""Seconds of the operation run before any is timed, for the clocks to rise."""


@dataclass(frozen=True)
class PeakResult:
    dtype: str
    device: str
    device_name: str
    size: int
    flops_per_s: float
    """Median over the runs."""
    min_flops_per_s: float
    max_flops_per_s: float
    reps: int
    products_per_rep: int
    threads: int
    spread: float = 0.0
    """(max - min) / median of the runs kept (``kasoku.perf.noise.spread``)."""
    stable: bool = True
    """Whether the runs agree within ``kasoku.perf.noise.SPREAD_LIMIT``, after up to twice
    as many runs again where the first ones did not."""

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul_peak(device: str | torch.device, dtype: str, size: int | None = None,
                        reps: int | None = None) -> PeakResult:
    """Measure the product rate of two ``size``x``size`` matrices of ``dtype`` (a key of
    ``PEAK_DTYPES``) on ``device``, in FLOP/s (2 * size^3 per product)."""
    device = torch.device(device)
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"unknown peak dtype {dtype!r}; choose one of {', '.join(PEAK_DTYPES)}")
    if dtype == "tf32" and device.type != "cuda":
        raise ValueError("tf32 is a CUDA tensor-core mode; there is no tf32 peak on "
                         f"{device.type}")
    size = size or DEFAULT_SIZE.get(device.type, DEFAULT_SIZE["cpu"])
    reps = reps or (7 if device.type == "cuda" else 5)
    if size < 1 or reps < 1:
        raise ValueError(f"size and reps must be >= 1, got {size} and {reps}")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        rates, inner = _measure(device, PEAK_DTYPES[dtype], size, reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    s = spread(rates)
    return PeakResult(dtype=dtype, device=device.type, device_name=_device_name(device),
                      size=size, flops_per_s=s.median, min_flops_per_s=s.min,
                      max_flops_per_s=s.max, reps=len(rates), products_per_rep=inner,
                      threads=torch.get_num_threads(), spread=s.spread, stable=s.stable)


BANDWIDTH_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
"""The size of the copied tensor: both it and its copy far exceed the device's caches."""


@dataclass(frozen=True)
class BandwidthResult:
    device: str
    device_name: str
    size_bytes: int
    """The tensor copied (the bytes moved per copy are twice this: read and written)."""
    bytes_per_s: float
    """Median over the runs."""
    min_bytes_per_s: float
    max_bytes_per_s: float
    reps: int
    copies_per_rep: int
    threads: int
    spread: float = 0.0
    stable: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(device: str | torch.device, size_bytes: int | None = None,
                      reps: int | None = None) -> BandwidthResult:
    """Measure the device memory's copy rate on ``device``: bytes read and written per second
    copying a ``size_bytes`` tensor into another."""
    device = torch.device(device)
    if size_bytes is None:
        size_bytes = BANDWIDTH_BYTES.get(device.type, BANDWIDTH_BYTES["cpu"])
    reps = reps or (7 if device.type == "cuda" else 5)
    if size_bytes < 4 or reps < 1:
        raise ValueError(f"size_bytes must be >= 4 and reps >= 1, got {size_bytes} and {reps}")
    src = torch.ones(size_bytes // 4, device=device)
    dst = torch.empty_like(src)
    rates, inner = _rates(device, lambda: dst.copy_(src), 2.0 * src.numel() * 4, reps)
    s = spread(rates)
    return BandwidthResult(device=device.type, device_name=_device_name(device),
                           size_bytes=src.numel() * 4, bytes_per_s=s.median,
                           min_bytes_per_s=s.min, max_bytes_per_s=s.max, reps=len(rates),
                           copies_per_rep=inner, threads=torch.get_num_threads(),
                           spread=s.spread, stable=s.stable)


def _measure(device: torch.device, dtype: torch.dtype, size: int, reps: int):
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g).to(dtype)
    b = torch.randn(size, size, device=device, generator=g).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    return _rates(device, lambda: torch.mm(a, b, out=out), 2.0 * size ** 3, reps)


def _rates(device: torch.device, op, work: float, reps: int) -> tuple[list[float], int]:
    """``work`` (FLOPs or bytes of one ``op``) per second over ``reps`` timed runs, each of
    as many ``op``s back to back as last about ``TARGET_RUN_S``; more runs, a bounded few,
    where they disagree. Returns the rates and the ``op``s per run."""
    # Warm-up: library initialization, kernel selection, clocks ramping up (an idle GPU's
    # clocks take a fraction of a second to rise: a few products alone left an H200 measuring
    # 688 TFLOP/s where the step's own products ran at 714).
    one = max(_timed(device, op) for _ in range(3))
    warm_s = WARM_S.get(device.type, 0.0)
    if warm_s:
        reps_warm = max(1, round(warm_s / max(one, 1e-9)))
        _timed(device, lambda: [op() for _ in range(reps_warm)])
    inner = max(1, round(TARGET_RUN_S.get(device.type, 0.05) / max(one, 1e-9)))

    def run():
        for _ in range(inner):
            op()

    rates = [work * inner / _timed(device, run) for _ in range(reps)]
    while not spread(rates).stable and len(rates) < 3 * reps:
        rates.append(work * inner / _timed(device, run))
    return rates, inner


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # note: a host sync, outside the timed span
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
