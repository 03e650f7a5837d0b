"""The work a step's GPU kernels do, read from a trace whose operators carry their shapes
(``torch.profiler`` with ``record_shapes``): FLOPs for the math (matrix products,
convolutions, attention), bytes moved for the rest -- what each kernel class's time is judged
against (``kasoku.perf.profile.roofline``).

Each GPU kernel names the innermost host operator that launched it (the ``External id`` both
carry); that operator's shapes give its work, once per operator, in the class that took most
of its kernels' time (``kernels.kernel_class``, the window's rule for time by class):

- FLOPs of ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (2 per multiply-add), a convolution and its
  backward (from the input, weight and output sizes; the output's from the stride, padding and
  dilation the operator was called with), and fused attention: ``4 B H T S D`` forward and
  2.5 times that backward (FlashAttention-2's count of the products each pass runs), halved
  under a causal mask, whose skipped blocks the kernels never compute;
- bytes: a Triton kernel's every tensor argument read or written once (its inputs and outputs
  are its arguments; inductor's own ``kernel_num_gb`` where the trace has it), an ATen
  operator's inputs plus its output (the size of its largest input; none for a reduction,
  the written tensor only for a fill), a matrix product's operands and result (a product's
  limit is the slower of its FLOPs and its bytes).

An operator whose shapes the trace does not hold (a fused optimizer's tensor lists) has no
work here: the caller may know it (``optimizer_bytes``). A CUDA graph's replays launch no
operators; the step whose work is read runs eagerly (``Window``'s work step).

On a CPU the math runs in the host operators themselves: ``product_flops`` sums the FLOPs of
a step's products and convolutions from the operators alone (a script's peak fraction, where
no model is handed to kasoku: ``Window``'s ``cpu_shapes``).

Why our own: the profiler's ``with_flops`` counts FLOPs only for some products and nothing
for the kernels inductor generates, and ``FlopCounterMode`` counts an eager model's operators,
not the kernels a compiled step runs; neither says bytes.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from kasoku.perf.profile.kernels import kernel_class

DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
               "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
               "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
"""Bytes per element of the dtypes the profiler names (``Input type``)."""

PRODUCTS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1),
            "aten::baddbmm": (1, 2), "aten::_scaled_mm": (0, 1)}
"""Matrix products: the indices of their two operands."""

ATTENTION = {
    # op: (query, key, causal flag's index, backward?, the flag's value meaning causal)
    "aten::_cudnn_attention_forward": (0, 1, 10, False, "True"),
    "aten::_flash_attention_forward": (0, 1, 8, False, "True"),
    "aten::_efficient_attention_forward": (0, 1, 9, False, "1"),
    "aten::_cudnn_attention_backward": (1, 2, 14, True, "True"),
    "aten::_flash_attention_backward": (1, 2, 11, True, "True"),
    "aten::_efficient_attention_backward": (1, 2, 14, True, "1"),
}
"""The fused attention kernels' operators (the innermost, the one that launches): where their
query and key are, and where the causal flag is, in their ATen signatures."""
BACKWARD_FACTOR = 2.5
REDUCTIONS = ("sum", "mean", "amax", "amin", "argmax", "argmin", "max", "min", "norm", "std",
              "var", "any", "all")
WRITE_ONLY = ("aten::fill_", "aten::zero_", "aten::zeros", "aten::ones", "aten::full")


@dataclass
class ClassWork:
    """The work of one kernel class in one step: ``flop`` and ``bytes`` summed over its
    operators, the kernel time they took in the work step (``known_us``) and the time of its
    kernels whose operator's work is unknown (``unknown_us``); per dtype, the FLOPs of its
    products (their peak depends on it)."""
    flop: float = 0.0
    bytes: float = 0.0
    known_us: float = 0.0
    unknown_us: float = 0.0
    flop_by_dtype: dict | None = None

    def to_dict(self) -> dict:
        return {"flop": self.flop, "bytes": self.bytes, "known_us": self.known_us,
                "unknown_us": self.unknown_us, "flop_by_dtype": dict(self.flop_by_dtype or {})}


def numel(dims) -> int:
    return math.prod(dims) if dims else (1 if dims == [] else 0)


def _tensors(args: dict) -> list[tuple[list[int], int]]:
    """The operator's tensor inputs: (dims, bytes per element); scalars and lists left out."""
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    return [(d, DTYPE_BYTES[t]) for d, t in zip(dims, types)
            if t in DTYPE_BYTES and isinstance(d, list) and d]


def _conv_output(args: dict, name: str) -> tuple[list[int], list[int], int] | None:
    """(input dims, weight dims, output spatial size) of a forward convolution."""
    dims, concrete = args.get("Input Dims") or [], args.get("Concrete Inputs") or []
    if len(dims) < 2 or len(dims[0]) < 3 or len(dims[1]) != len(dims[0]):
        return None
    x, w = dims[0], dims[1]
    # aten::convolution(input, weight, bias, stride, padding, dilation, ...);
    # aten::cudnn_convolution(input, weight, padding, stride, dilation, groups, ...)
    at = {"aten::cudnn_convolution": (3, 2, 4)}.get(name, (3, 4, 5))

    def ints(i, default):
        try:
            v = [int(s) for s in concrete[i].strip("[]").split(",") if s.strip()]
        except (IndexError, ValueError):
            return [default] * (len(x) - 2)
        return v * (len(x) - 2) if len(v) == 1 else v
    stride, pad, dil = ints(at[0], 1), ints(at[1], 0), ints(at[2], 1)
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1
           for n, k, s, p, d in zip(x[2:], w[2:], stride, pad, dil)]
    return x, w, math.prod(out)


def op_flop(name: str, args: dict) -> float:
    """The FLOPs of one operator's run, from its shapes (0 for what is not math)."""
    dims = args.get("Input Dims") or []
    if name in PRODUCTS:
        a, b = (dims[i] for i in PRODUCTS[name])
        if len(a) < 2 or len(b) < 2:
            return 0.0
        return 2.0 * numel(a) * b[-1]
    if name in ATTENTION:
        q_at, k_at, causal_at, backward, causal_value = ATTENTION[name]
        q, k = dims[q_at], dims[k_at]
        if len(q) != 4 or len(k) != 4:
            return 0.0
        # [B, H, T, D] or [B, T, H, D]: the sequence is the longer of the middle two.
        keys = max(k[1], k[2])
        flop = 4.0 * numel(q) * keys
        concrete = args.get("Concrete Inputs") or []
        if causal_at < len(concrete) and concrete[causal_at] == causal_value:
            flop /= 2
        return flop * (BACKWARD_FACTOR if backward else 1.0)
    if name in ("aten::convolution", "aten::_convolution", "aten::cudnn_convolution"):
        conv = _conv_output(args, name)
        if conv is None:
            return 0.0
        x, w, out = conv
        return 2.0 * x[0] * numel(w) * out
    if name == "aten::convolution_backward":
        # (grad_output, input, weight, ...): grad of the input and of the weight, each the
        # forward's FLOPs: 2 N K C k...k Hout Wout.
        if len(dims) < 3 or len(dims[0]) < 3:
            return 0.0
        g, w = dims[0], dims[2]
        return 2 * 2.0 * g[0] * numel(w) * numel(g[2:])
    return 0.0


def op_bytes(name: str, args: dict) -> float:
    """The bytes one operator's run reads and writes, from its shapes (0 if none recorded)."""
    if "kernel_num_gb" in args:
        return float(args["kernel_num_gb"]) * 1e9
    tensors = [numel(d) * size for d, size in _tensors(args)]
    if not tensors:
        return 0.0
    if name.startswith("triton_"):
        return float(sum(tensors))  # every argument is a buffer it reads or writes
    if name in WRITE_ONLY:
        return float(tensors[0])
    if name in ("aten::copy_", "aten::_to_copy", "aten::to"):
        return float(tensors[-1] + tensors[0]) if name == "aten::copy_" else 2.0 * tensors[0]
    if name in PRODUCTS or name in ATTENTION:
        return float(sum(tensors) + max(tensors))
    base = name.removeprefix("aten::").strip("_")
    if any(base == r or base.startswith(r + ".") for r in REDUCTIONS):
        return float(sum(tensors))
    return float(sum(tensors) + max(tensors))


def dtype_of(args: dict) -> str:
    """The first tensor input's dtype, as a peak's dtype: ``bf16``, ``fp16``, ``fp32``."""
    for t in args.get("Input type") or []:
        if t in ("c10::BFloat16",):
            return "bf16"
        if t in ("c10::Half",):
            return "fp16"
        if t == "float":
            return "fp32"
    return "fp32"


GRAPH_KERNELS = 16
"""An operator that launched this many kernels of several classes is a CUDA graph's replay or a
compiled region's (an operator launches a few; a foreach update many of one class): the
shapes it was called with say nothing of its kernels' work, which is unknown."""


def class_work(events: list[dict], steps: int = 1) -> dict[str, ClassWork]:
    """Per ``KERNEL_CLASSES`` entry, the work per step of the kernels in ``events`` (a trace
    recorded with shapes; ``steps`` steps of it)."""
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "External id" in (e.get("args") or {}):
            ops.setdefault(e["args"]["External id"], e)
    # Each operator's kernels together: its work goes to the class that took most of their
    # time (a product's split-K reduction and the memset before it are the product's).
    launched: dict = defaultdict(list)
    work: dict[str, ClassWork] = defaultdict(ClassWork)
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ext = (k.get("args") or {}).get("External id")
        if ext in ops:
            launched[ext].append(k)
        else:
            work[kernel_class(k.get("name", ""))].unknown_us += k.get("dur", 0.0)
    for ext, kernels in launched.items():
        by_class: dict = defaultdict(float)
        for k in kernels:
            by_class[kernel_class(k.get("name", ""))] += k.get("dur", 0.0)
        if len(kernels) >= GRAPH_KERNELS and len(by_class) > 1:  # a graph's: work unknown
            for c, us in by_class.items():
                work[c].unknown_us += us
            continue
        cls = max(by_class, key=by_class.get)
        w, us = work[cls], sum(by_class.values())
        args = ops[ext].get("args") or {}
        flop, nbytes = op_flop(ops[ext]["name"], args), op_bytes(ops[ext]["name"], args)
        if flop == 0.0 and nbytes == 0.0:
            w.unknown_us += us
            continue
        w.known_us += us
        w.flop += flop
        w.bytes += nbytes
        if flop:
            w.flop_by_dtype = w.flop_by_dtype or {}
            dt = dtype_of(args)
            w.flop_by_dtype[dt] = w.flop_by_dtype.get(dt, 0.0) + flop
    for w in work.values():
        w.flop, w.bytes = w.flop / steps, w.bytes / steps
        w.known_us, w.unknown_us = w.known_us / steps, w.unknown_us / steps
        if w.flop_by_dtype:
            w.flop_by_dtype = {k: v / steps for k, v in w.flop_by_dtype.items()}
    return dict(work)


def optimizer_bytes(optimizer) -> float:
    """The bytes one update of ``optimizer`` (a ``torch.optim.Optimizer``) reads and writes:
    each parameter read and written, its gradient read, each of its state tensors of its
    size (Adam's two moments, SGD's momentum) read and written."""
    total = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None and not optimizer.state.get(p):
                continue
            size = p.numel() * p.element_size()
            state = [t for t in (optimizer.state.get(p) or {}).values()
                     if hasattr(t, "numel") and t.numel() == p.numel()]
            total += 3 * size + sum(2 * t.numel() * t.element_size() for t in state)
    return total


CONVOLUTIONS = ("aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
                "aten::convolution_backward")


def product_flops(events: list[dict], steps: int = 1,
                  between: tuple[float, float] | None = None) -> dict[str, float]:
    """Per dtype (``dtype_of``), the FLOPs per step of the matrix products and convolutions
    among the host operators of ``events`` (a CPU trace recorded with shapes) that start
    ``between`` two times of the trace's clock (all where None), ``steps`` steps: a CPU
    step's math, which runs in its operators. Each is counted once, at the outermost
    operator ``op_flop`` counts (``aten::convolution`` calls ``aten::_convolution`` on the
    same thread, within its span); empty where none ran."""
    lo, hi = between or (float("-inf"), float("inf"))
    counted = [e for e in events if e.get("cat") == "cpu_op"
               and (e.get("name") in PRODUCTS or e.get("name") in CONVOLUTIONS)
               and lo <= float(e.get("ts", 0.0)) < hi]
    counted.sort(key=lambda e: (str(e.get("pid")), str(e.get("tid")), float(e.get("ts", 0.0)),
                                -float(e.get("dur", 0.0))))
    flops: dict[str, float] = defaultdict(float)
    inside, end = None, 0.0  # the thread and end of the last counted operator
    for e in counted:
        thread, ts = (e.get("pid"), e.get("tid")), float(e.get("ts", 0.0))
        if thread == inside and ts < end:
            continue
        flop = op_flop(e["name"], e.get("args") or {})
        if flop:
            flops[dtype_of(e.get("args") or {})] += flop / steps
            inside, end = thread, ts + float(e.get("dur", 0.0))
    return dict(flops)
