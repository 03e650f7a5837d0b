"""The precision lever (seed 004's Tensor Core rung): fp32 | tf32 | fp16 | bf16 | fp16-pure.

Two phases, because fp16-pure changes the weights and what the optimizer must hold::

    plan = apply_precision(model, mode, device, notes)    # TF32 flags, fp16 weights, scaler
    optimizer = make_optimizer(plan.params, impl)         # fp32 masters for fp16-pure
    step = plan.make_step(loss_fn, metric_fn)             # step(model, batch, optimizer)

- ``fp32``: TF32 off for matmuls and cuDNN convolutions (true fp32 arithmetic).
- ``tf32``: TF32 on for both (CUDA only; on a CPU: warned once, runs fp32).
- ``bf16``: autocast to bfloat16 (CUDA and CPU); no loss scaling (bf16 has fp32's range).
- ``fp16``: autocast to float16, fp32 weights, dynamic loss scaling (``LossScaler``).
- ``fp16-pure``: fp16 weights and activations (BatchNorm stays fp32, as in apex's O2),
  fp32 master weights held by the optimizer, dynamic loss scaling; the model takes and returns
  fp32 tensors (casts at its boundary), so evaluators and loss functions need no change.

fp16 and fp16-pure need CUDA: on a CPU they are warned about once and run as fp32
(``build_precision`` builds them anyway, which is how the tests exercise them on a CPU).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from kasoku.accel.config import PRECISIONS
from kasoku.accel.loss_scale import LossScaler, MasterWeights, PrecisionState
from kasoku.accel.notes import skip
from kasoku.core.errors import ConfigError
from kasoku.train.step import StandardStep


def set_tf32(enabled: bool) -> None:
    """TF32 for CUDA matmuls and cuDNN convolutions (global flags; no effect on a CPU)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@dataclass
class PrecisionPlan:
    """What ``apply_precision`` decided. ``mode``: the precision that runs on this device
    (fp32 after a fallback); ``params``: what the optimizer must update (fp32 masters for
    fp16-pure, else the model's parameters); ``scaler``: the loss scaler of fp16 modes;
    ``extensions``: trainer extensions to register (the scaler's and masters' snapshot state)."""
    mode: str
    model: nn.Module
    device: torch.device
    params: list
    autocast_dtype: torch.dtype | None = None
    scaler: LossScaler | None = None
    extensions: list = field(default_factory=list)

    def make_step(self, loss_fn: Callable, metric_fn: Callable | None = None) -> StandardStep:
        """The step of this precision: ``StandardStep`` with its autocast and, for the fp16
        modes, the loss scaler attached as its update."""
        autocast = contextlib.nullcontext if self.autocast_dtype is None else \
            functools.partial(torch.autocast, self.device.type, dtype=self.autocast_dtype)
        return StandardStep(loss_fn, metric_fn, autocast=autocast, update=self.scaler)


def apply_precision(model: nn.Module, mode: str, device, notes: list[str] | None = None,
                    loss_scale_init: float = 2.0 ** 16) -> PrecisionPlan:
    """Apply precision ``mode`` to ``model`` (already on ``device``); ``loss_scale_init``: the
    first dynamic loss scale of the fp16 modes. A mode this device cannot run is warned about
    once, noted, and replaced by fp32; an unknown mode is refused (``build_precision``)."""
    device = torch.device(device)
    if device.type != "cuda" and mode == "tf32":
        skip(notes, f"precision tf32: no effect on {device.type} (TF32 is a CUDA Tensor Core "
                    f"format); running fp32")
        mode = "fp32"
    if device.type != "cuda" and mode in ("fp16", "fp16-pure"):
        skip(notes, f"precision {mode}: float16 training needs a CUDA device; running fp32 on "
                    f"{device.type} (bf16 is the reduced precision CPUs train in)")
        mode = "fp32"
    return build_precision(model, mode, device, loss_scale_init=loss_scale_init)


def build_precision(model: nn.Module, mode: str, device, loss_scale_init: float = 2.0 ** 16
                    ) -> PrecisionPlan:
    """``apply_precision`` without the device policy: builds ``mode`` on any device."""
    device = torch.device(device)
    if mode in ("fp32", "tf32"):
        set_tf32(mode == "tf32")
        return PrecisionPlan(mode, model, device, list(model.parameters()))
    if mode == "bf16":
        return PrecisionPlan(mode, model, device, list(model.parameters()),
                             autocast_dtype=torch.bfloat16)
    if mode == "fp16":
        scaler = LossScaler(device, init_scale=loss_scale_init)
        return PrecisionPlan(mode, model, device, list(model.parameters()),
                             autocast_dtype=torch.float16, scaler=scaler,
                             extensions=[PrecisionState(scaler)])
    if mode == "fp16-pure":
        cast_to_half(model)
        master = MasterWeights(model.parameters())
        scaler = LossScaler(device, init_scale=loss_scale_init, master=master)
        return PrecisionPlan(mode, model, device, master.params, scaler=scaler,
                             extensions=[PrecisionState(scaler)])
    raise ConfigError(f"unknown precision {mode!r}; choose one of {', '.join(PRECISIONS)}")


_KEEP_FP32 = (nn.modules.batchnorm._BatchNorm,)
"""Modules whose weights and running statistics stay fp32 in fp16-pure: BatchNorm's variance
needs fp32, and cuDNN normalizes fp16 activations with fp32 parameters."""


def cast_to_half(model: nn.Module) -> nn.Module:
    """fp16-pure: float16 weights and buffers except in ``_KEEP_FP32`` modules (in place: the
    Parameter objects stay the same), plus hooks that cast floating inputs to float16 and
    floating outputs back to float32 at the model's boundary."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _KEEP_FP32):
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.half()
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.half())
    model.register_forward_pre_hook(_inputs_to_half)
    model.register_forward_hook(_outputs_to_float)
    return model


def _cast_floating(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floating(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    return value


def _inputs_to_half(module, args):
    return _cast_floating(args, torch.float16)


def _outputs_to_float(module, args, output):
    return _cast_floating(output, torch.float32)
