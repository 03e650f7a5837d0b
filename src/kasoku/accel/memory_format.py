"""channels_last (NHWC) memory format for conv nets (seed 004: cuDNN's Tensor Core kernels
read NHWC; in NCHW every convolution pays a transpose)."""
from __future__ import annotations

import torch
from torch import nn

from kasoku.accel.notes import skip
from kasoku.train.step import StepWrapper


def has_conv2d(model: nn.Module) -> bool:
    """Whether ``model`` has a 2-d convolution (a weight of 4 dimensions)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) and m.weight.dim() == 4
               for m in model.modules())


def apply_channels_last(model: nn.Module, notes: list[str] | None = None) -> nn.Module:
    """Convert ``model``'s 4-d weights to channels_last in place. A model without 2-d
    convolutions (MLP, LSTM) is left as it is, with one warning and a note. Inputs are
    converted in the step: wrap it with ``ChannelsLastInputs``."""
    if not has_conv2d(model):
        skip(notes, f"channels_last: {type(model).__name__} has no 2-d convolution; "
                    f"memory format unchanged")
        return model
    return model.to(memory_format=torch.channels_last)


class ChannelsLastInputs(StepWrapper):
    """Step wrapper: 4-d inputs go to the model in channels_last (a copy, inside the step so a
    CUDA graph captures it); other inputs pass unchanged. Its inner step runs eagerly: phase
    marks reach it."""

    def __call__(self, model, batch, optimizer) -> dict:
        inputs, targets = batch
        if inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return self.inner(model, (inputs, targets), optimizer)

    def __repr__(self) -> str:
        return f"ChannelsLastInputs({self.inner!r})"
