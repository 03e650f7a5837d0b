"""Weight gradients on a second CUDA stream, joined once at the end of the backward pass.

In the backward pass each convolution turns its output gradient ``dy`` into two products: the
input gradient ``dx``, which the layer below waits for, and the weight gradient ``dw``, which
nothing reads before the optimizer. Autograd runs them one after the other on one stream, and
at small batches neither fills an H200. Here ``dw`` goes to a second stream, ordered after
everything the main stream has queued so far, and the main stream goes on with ``dx`` and the
layers below, so the compute-bound weight-gradient products run beside the memory-bound
batch-norm backward kernels. The streams join once, when the backward pass ends (an autograd
engine callback, before ``backward()`` returns), so the loss scaler, gradient clipping and the
optimizer read finished gradients. (Joining after each layer instead, as a first version did,
left too little to overlap: research/notebook.md.)

What keeps it correct:

- the side stream waits for the main stream before each product, so it reads finished ``dy``
  and activations;
- ``dy``, the saved activation and the cast weight are recorded as used on the side stream, so
  the caching allocator does not give their memory to the main stream before the side stream
  has read it (under CUDA-graph capture it keeps them until the capture ends);
- inductor must not reuse ``dy``'s buffer for a later kernel's output, which it does in its
  generated code, out of the allocator's sight: with this lever ``kasoku.accel.compile`` turns
  inductor's buffer reuse off;
- ``dw`` has the parameter's dtype and strides, so autograd makes it the parameter's ``.grad``
  without a copy kernel that would read it on the main stream before the join.

``WgradStreamConv2d`` (any ``nn.Conv2d`` with zero padding given as numbers) and
``kasoku.accel.conv_matmul.Conv1x1Matmul`` with ``wgrad_stream`` set keep the original
Parameters and ``state_dict``. Off CUDA the products run in order on the CPU, through the same
code, which is what the CPU tests check.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Variable

from kasoku.accel._recast import recast
from kasoku.accel.notes import skip

_side_streams: dict[int, torch.cuda.Stream] = {}
_queued_task = -1  # the backward pass (autograd graph task) whose join is queued


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of a CUDA ``device`` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(index)
    return stream


def wgrad_side_stream(model: nn.Module, device: torch.device) -> torch.cuda.Stream | None:
    """The second stream ``model``'s weight gradients are made on; None when none of its
    layers routes one there, or off CUDA."""
    if device.type != "cuda" or not any(
            isinstance(m, WgradStreamConv2d) or getattr(m, "wgrad_stream", False) is True
            for m in model.modules()):
        return None
    return side_stream(device)


def join_all() -> None:
    """Make each device's current stream wait for everything queued on its side stream."""
    for index, side in _side_streams.items():
        torch.cuda.current_stream(index).wait_stream(side)


def _join_at_end_of_backward() -> None:
    global _queued_task
    task = torch._C._current_graph_task_id()
    if task < 0:  # called outside a backward pass: nothing will join later
        join_all()
    elif task != _queued_task:
        _queued_task = task
        # Looked up at call time, so a test can count the joins.
        Variable._execution_engine.queue_callback(lambda: join_all())


def _deferred(product, reads: tuple[Tensor, ...]) -> Tensor:
    """``product()`` on the side stream of ``reads[0]``'s device (inline off CUDA), joined with
    the main stream when the backward pass ends."""
    if not reads[0].is_cuda:
        out = product()
    else:
        main = torch.cuda.current_stream(reads[0].device)
        side = side_stream(reads[0].device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = product()
        for t in reads:
            t.record_stream(side)
        out.record_stream(main)
    _join_at_end_of_backward()
    return out


def _as_param(dw: Tensor, weight: Tensor) -> Tensor:
    """``dw`` in ``weight``'s dtype and strides (what autograd takes as ``.grad`` uncopied)."""
    dw = dw.to(weight.dtype)
    if dw.stride() != weight.stride():
        dw = torch.empty_like(weight).copy_(dw)
    return dw


@torch.library.custom_op("kasoku::wgrad_mm", mutates_args=())
def wgrad_mm(grad: Tensor, rows: Tensor, weight: Tensor) -> Tensor:
    """The weight gradient ``grad^T @ rows`` of ``rows @ weight.flatten(1)^T``, shaped like
    ``weight`` and in its dtype, computed on the side stream."""
    def product():
        if grad.is_cuda and weight.dtype == torch.float32 \
                and grad.dtype in (torch.float16, torch.bfloat16):
            dw = torch.mm(grad.t(), rows, out_dtype=torch.float32)  # fp32 accumulate, no cast
        else:
            dw = torch.mm(grad.t(), rows).to(weight.dtype)
        return dw.view(weight.shape)
    return _deferred(product, (grad, rows))


@wgrad_mm.register_fake
def _(grad, rows, weight):
    return weight.new_empty(weight.shape)


@torch.library.custom_op("kasoku::wgrad_conv2d", mutates_args=())
def wgrad_conv2d(grad: Tensor, x: Tensor, w: Tensor, weight: Tensor, stride: list[int],
                 padding: list[int], dilation: list[int], groups: int) -> Tensor:
    """The weight gradient of ``conv2d(x, w)`` for output gradient ``grad``, in ``weight``'s
    dtype and strides (``w`` is ``weight`` as the forward used it, cast or not), computed on
    the side stream."""
    def product():
        dw = torch.ops.aten.convolution_backward.default(
            grad, x, w, None, stride, padding, dilation, False, [0, 0], groups,
            [False, True, False])[1]
        return _as_param(dw, weight)
    return _deferred(product, (grad, x, w))


@wgrad_conv2d.register_fake
def _(grad, x, w, weight, stride, padding, dilation, groups):
    return torch.empty_like(weight)


def _compute_inputs(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and ``weight`` as autocast would hand them to a convolution (unchanged without
    autocast)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        return x.to(dtype), weight.to(dtype)
    return x, weight


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, stride, padding, dilation, groups):
        x, w = _compute_inputs(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            y = F.conv2d(x, w, None, stride, padding, dilation, groups)
        ctx.save_for_backward(x, w, weight)
        ctx.conv = (list(stride), list(padding), list(dilation), groups)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        dx = dw = None
        # The input gradient first: the layers below wait for it, and the GPU gives the
        # kernel launched first its multiprocessors first.
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.convolution_backward.default(
                grad, x, w, None, stride, padding, dilation, False, [0, 0], groups,
                [True, False, False])[0]
        if ctx.needs_input_grad[1]:
            dw = wgrad_conv2d(grad, x, w, weight, stride, padding, dilation, groups)
        return dx, dw, None, None, None, None


class _Linear(torch.autograd.Function):
    """``rows @ weight.flatten(1)^T`` (a 1x1 convolution as a matrix product)."""

    @staticmethod
    def forward(ctx, rows, weight):
        rows, w = _compute_inputs(rows, weight)
        w = w.flatten(1)
        with torch.autocast(rows.device.type, enabled=False):
            y = F.linear(rows, w)
        ctx.save_for_backward(rows, w, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        rows, w, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:  # first, as in _Conv2d
            dx = grad @ w
        if ctx.needs_input_grad[1]:
            dw = wgrad_mm(grad, rows, weight)
        return dx, dw


def linear(rows: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(rows, weight.flatten(1), bias)`` with the weight gradient on the side
    stream."""
    y = _Linear.apply(rows, weight)
    return y if bias is None else y + bias.to(y.dtype)


def conv2d(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``conv(x)`` with the weight gradient on the side stream (``conv``: a ``deferrable``
    convolution)."""
    y = _Conv2d.apply(x, conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups)
    return y if conv.bias is None else y + conv.bias.to(y.dtype).view(1, -1, 1, 1)


def deferrable(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain ``nn.Conv2d`` (zero padding given as numbers) whose weight
    gradient ``WgradStreamConv2d`` can compute."""
    return type(conv) is nn.Conv2d and conv.padding_mode == "zeros" \
        and not isinstance(conv.padding, str)


class WgradStreamConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight gradient is computed on a second CUDA stream (see the
    module's doc)."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "WgradStreamConv2d":
        if not deferrable(conv):
            raise ValueError(f"cannot defer the weight gradient of {conv}: needs an nn.Conv2d "
                             f"with zero padding given as numbers")
        return recast(conv, cls)

    def forward(self, x: Tensor) -> Tensor:
        return conv2d(self, x)


def convert(model: nn.Module) -> int:
    """Give ``model``'s convolutions side-stream weight gradients in place; returns how many.
    A layer that computes its own forward and declares a ``wgrad_stream`` attribute (such as
    ``kasoku.accel.conv_matmul.Conv1x1Matmul``) has it set, and routes its products here
    itself; plain ``nn.Conv2d`` layers become ``WgradStreamConv2d``."""
    changed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(getattr(type(child), "wgrad_stream", None), bool):
                child.wgrad_stream = True
                changed += 1
            elif deferrable(child):
                setattr(parent, name, WgradStreamConv2d.from_conv(child))
                changed += 1
    return changed


def apply_wgrad_stream(model: nn.Module, device=None, notes: list[str] | None = None
                       ) -> nn.Module:
    """On a CUDA device: the weight gradients of ``model``'s convolutions on a second stream
    (see the module's doc), in place. Skipped with a note off CUDA and for a model without
    convolutions. Compile the model with inductor's buffer reuse off (``apply_compile``'s
    ``buffer_reuse=False``)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        where = device.type if device is not None else "an unknown device"
        skip(notes, f"wgrad_stream: a second CUDA stream, not on {where}; skipped")
        return model
    if not convert(model):
        skip(notes, f"wgrad_stream: {type(model).__name__} has no 2-d convolution; nothing "
                    f"changed")
    return model
