"""Where a training step's time goes, by kind of kernel: convolutions and matrix products
(cuDNN, cuBLAS), Triton kernels (what torch.compile generates: batch norm, ReLU, adds and
other memory-bound chains), the optimizer's update, copies and fills, the rest.

The split answers seed 004's question of which lever is next: a step whose time is mostly
Triton kernels is bound by memory traffic (fusing more helps; faster convolutions do not), one
whose kernel time is far below its wall time is bound by the host (graphs, larger batches).

``profile_steps(run, device)`` runs ``run()`` under ``torch.profiler`` and returns a
``Breakdown``: on CUDA the device time of every kernel, on a CPU the self time of every
operator. ``classify`` is the rule, by name.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

CATEGORIES = ("conv/matmul", "triton", "optimizer", "copy/fill", "other")

_CONV_MATMUL = ("conv", "xmma", "implicit", "dgrad", "wgrad", "fprop", "cudnn", "cublas", "sm90",
                "sm80", "cutlass", "nvjet", "gemm", "mkldnn", "addmm", "matmul", "aten::mm",
                "aten::bmm", "aten::linear")
_OPTIMIZER = ("multi_tensor", "fused", "foreach", "sgd", "adam")
_COPY_FILL = ("memcpy", "memset", "aten::copy_", "aten::fill_", "aten::zero_",
              "aten::empty", "aten::to", "aten::_to_copy", "aten::clone")


_KASOKU_TRITON = ("bn_stats_kernel", "bn_forward_kernel", "bn_backward", "bn_running_kernel",
                  "max_pool_forward_kernel", "max_pool_backward_kernel", "crop_kernel")
"""kasoku's own Triton kernels (``kasoku.accel.bn_kernels``, ``max_pool``, the loader's crop):
memory-bound chains like inductor's, named without "triton"."""

OPTIMIZER_PREFIX = "optimizer step: "
"""Prefixed to a CPU operator that ran inside ``Optimizer.step``."""


FUSED_ATTENTION = ("flash", "fmha", "efficient_attention", "native_sdpa")
"""Name parts of fused attention kernels: FlashAttention (``flash_fwd_kernel``), the
memory-efficient one (``fmha_cutlassF_...``, ``efficient_attention``), cuDNN's
(``cudnn_generated_fort_native_sdpa``)."""


def attention_kind(name: str) -> str | None:
    """``fused`` for a fused attention kernel, ``softmax`` for a softmax kernel (an unfused
    attention's; the loss's log-softmax excluded where its name says so), else None."""
    low = name.lower()
    if any(k in low for k in FUSED_ATTENTION):
        return "fused"
    if "softmax" in low and "logsoftmax" not in low and "log_softmax" not in low:
        return "softmax"
    return None


KERNEL_CLASSES = ("matmul/conv", "attention", "norm/element-wise", "loss/softmax", "optimizer",
                  "copies", "communication", "input", "other")
"""What a GPU kernel does, as far as its time's limit goes: matrix products and convolutions
(the math), fused attention, normalization and element-wise chains, the loss and softmax
(reductions over a row of logits), the optimizer's update, copies and fills, collectives, and
the input pipeline's own kernels (a GPU loader's JPEG decoding and crops: not the model's
work, never judged against a limit). The classes of the verdict per kernel class: each has its
own limit (the matmul peak for the math and attention, the memory's bandwidth for the rest)."""

INPUT_KERNELS = ("nvjpeg", "nvimgcodec", "crop_kernel", "dali::")
"""Name parts of an input pipeline's kernels: nvJPEG's and nvImageCodec's decoding and colour
conversion (``nvjpeg::rgba2rgb<...RGBAToRGBConversion...>``, which the rule for convolutions
would otherwise take for one), kasoku's crop (``kasoku.data.crop_kernel``), DALI's."""

_ATTENTION = FUSED_ATTENTION + ("compute_dot_do_o", "convert_dq_to_16bits", "sdpa")
"""Fused attention kernels and the helpers of cuDNN's attention backward."""
_LOSS = ("softmax", "nll", "cross_entropy", "argmax")
_NORM = ("layer_norm", "batch_norm", "group_norm", "rms_norm", "bn_")
_COPIES = ("memcpy", "memset", "copy_kernel", "fillfunctor", "fill_kernel",
           "catarraybatchedcopy")


def kernel_class(name: str) -> str:
    """The ``KERNEL_CLASSES`` entry of a GPU kernel, from its name: inductor's kernels by the
    operators their name lists (``triton_tem_`` a matrix-product template, the rest fused
    element-wise chains and reductions unless they hold the loss's softmax)."""
    low = name.lower()
    if any(k in low for k in INPUT_KERNELS):
        return "input"
    if "nccl" in low:
        return "communication"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in ("multi_tensor", "fused_adam", "foreach", "adam")):
        return "optimizer"
    if any(k in low for k in _LOSS):
        return "loss/softmax"
    if low.startswith("triton_tem_"):
        return "matmul/conv"
    if "triton" in low or name.startswith(_KASOKU_TRITON) or any(k in low for k in _NORM):
        return "norm/element-wise"
    if any(k in low for k in _CONV_MATMUL):
        return "matmul/conv"
    if any(k in low for k in _COPIES):
        return "copies"
    if "elementwise" in low or "reduce_kernel" in low:
        return "norm/element-wise"
    return "other"


def classify(name: str) -> str:
    """The category of a kernel (CUDA) or operator (CPU) from its name."""
    low = name.lower()
    if name.startswith(OPTIMIZER_PREFIX):
        return "optimizer"
    if any(k in low for k in INPUT_KERNELS):
        return "other"  # a loader's decoding and crop ("...Conversion" is no convolution)
    if "triton" in low or name.startswith(_KASOKU_TRITON):
        return "triton"
    if any(k in low for k in _CONV_MATMUL):
        return "conv/matmul"
    if any(k in low for k in _OPTIMIZER):
        return "optimizer"
    if any(k in low for k in _COPY_FILL):
        return "copy/fill"
    return "other"


@dataclass
class Breakdown:
    steps: int
    wall_s: float
    """Wall time of the profiled steps (device work finished), profiler overhead included."""
    device: str
    by_category_s: dict[str, float] = field(default_factory=dict)
    kernels: list[tuple[str, float, int]] = field(default_factory=list)
    """(name, seconds, launches) over all profiled steps, longest first."""

    @property
    def kernel_s(self) -> float:
        return sum(self.by_category_s.values())

    def per_step_ms(self) -> dict[str, float]:
        return {c: 1e3 * s / self.steps for c, s in self.by_category_s.items()}

    def to_dict(self, top: int = 25) -> dict:
        return {"steps": self.steps, "device": self.device,
                "wall_ms_per_step": 1e3 * self.wall_s / self.steps,
                "kernel_ms_per_step": 1e3 * self.kernel_s / self.steps,
                "launches_per_step": sum(n for _, _, n in self.kernels) / self.steps,
                "by_category_ms_per_step": self.per_step_ms(),
                "top": [{"name": n, "ms_per_step": 1e3 * s / self.steps,
                         "launches_per_step": c / self.steps}
                        for n, s, c in self.kernels[:top]]}


def breakdown(timings: Iterable[tuple[str, float]], steps: int, wall_s: float,
              device: str) -> Breakdown:
    """A ``Breakdown`` from ``(name, seconds)`` pairs, one per kernel launch."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for name, seconds in timings:
        total[name] += seconds
        count[name] += 1
    by_category = {c: 0.0 for c in CATEGORIES}
    for name, seconds in total.items():
        by_category[classify(name)] += seconds
    kernels = sorted(((n, s, count[n]) for n, s in total.items()), key=lambda k: -k[1])
    return Breakdown(steps, wall_s, device, by_category, kernels)


def profile_steps(run: Callable[[], object], device: torch.device | str, steps: int) -> Breakdown:
    """Profile ``run()`` (which runs ``steps`` training steps, warm already): on CUDA every
    kernel's device time, on a CPU every operator's self time."""
    from torch.profiler import ProfilerActivity, profile
    device = torch.device(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - t0
    events = list(prof.events())
    timings = []
    if cuda:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                timings.append((e.name, _device_us(e) / 1e6))
        return breakdown(timings, steps, wall_s, device.type)
    # A CPU optimizer's operators (add_, mul_, addcdiv_...) are named like any other: they
    # count as the optimizer's when they run inside its step.
    updates = [(e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("Optimizer.step")]
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            inside = any(a <= e.time_range.start and e.time_range.end <= b for a, b in updates)
            timings.append((OPTIMIZER_PREFIX + e.name if inside else e.name,
                            e.self_cpu_time_total / 1e6))
    return breakdown(timings, steps, wall_s, device.type)


def _device_us(event) -> float:
    for attr in ("device_time", "cuda_time"):
        value = getattr(event, attr, None)
        if value is not None:
            return value
    return 0.0


def format_breakdown(b: Breakdown, top: int = 15) -> str:
    what = "kernel" if b.device == "cuda" else "operator self"
    d = b.to_dict(top)
    lines = [f"{b.steps} steps: {d['wall_ms_per_step']:.2f} ms/step wall, "
             f"{d['kernel_ms_per_step']:.2f} ms/step {what} time "
             f"({d['launches_per_step']:.0f} launches/step)"]
    kernel = b.kernel_s or 1.0
    for c in CATEGORIES:
        s = b.by_category_s.get(c, 0.0)
        lines.append(f"  {c:12s} {1e3 * s / b.steps:8.3f} ms/step  {100 * s / kernel:5.1f}%")
    for row in d["top"]:
        lines.append(f"  {row['ms_per_step']:8.3f} ms x{row['launches_per_step']:4.0f}  "
                     f"{row['name'][:100]}")
    return "\n".join(lines)
