"""float8 matrix products for training through torchao (an optional dependency): each
``nn.Linear`` becomes torchao's ``Float8Linear``, whose forward and backward products run on
Hopper's and Ada's float8 tensor cores with dynamic scales, ``tensorwise`` (one scale per
tensor; cuBLAS) or ``rowwise`` (one per row; CUTLASS, more accurate). torchao's
``convert_to_float8_training`` keeps each layer's Parameter objects and names, so the optimizer
and snapshots are unchanged.

Layers whose dimensions are not multiples of 16 stay as they are (the float8 kernels need
it), as torchao's documentation filters them. Compile the model too: without inductor fusing
the casts and scales into neighbouring kernels, float8 is rarely faster.

It pays only for wide matrices: each product's casts and scales cost memory traffic in
proportion to its inputs, the saving grows with its FLOPs. A transformer's MLP on 16,384
tokens, compiled, on an H100 (``benchmarks/float8_shapes.py``, docs/benchmarks.md):
tensorwise 0.82x bf16 at 768 wide, 1.00x at 1,280 and 1,600, 1.08x at 2,048, 1.39x at 4,096,
1.58x at 8,192; rowwise below tensorwise at every width. GPT-2's widths (768 to 1,600) are
below the crossing, so the bench measures it and the verdict does not advise it.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

from kasoku.accel.config import FLOAT8_RECIPES
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (8.9) and Hopper (9.0) or newer."""


def has_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_float8(recipe: str, device) -> None:
    """Refuse, in one line, float8 where it cannot run: an unknown recipe, a device that is
    not a CUDA GPU of compute capability 8.9 or newer, torchao not installed."""
    device = torch.device(device)
    if recipe not in FLOAT8_RECIPES:
        raise ConfigError(f"unknown float8 scaling {recipe!r}; choose one of "
                          f"{', '.join(FLOAT8_RECIPES)}")
    if device.type != "cuda":
        raise ConfigError(f"{flag('accel.float8')} {recipe}: float8 matrix products need a CUDA "
                          "GPU with float8 tensor cores (compute capability 8.9+), not "
                          f"{device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"{flag('accel.float8')} {recipe}: this GPU has compute capability "
                          f"{'.'.join(map(str, capability))}; float8 tensor cores need 8.9 "
                          f"(Ada) or 9.0 (Hopper) and newer")
    if not has_torchao():
        raise ConfigError(f"{flag('accel.float8')} {recipe} needs torchao: pip install torchao")


def _float8_shaped(module: nn.Module, fqn: str) -> bool:
    return not isinstance(module, nn.Linear) or (
        module.in_features % 16 == 0 and module.out_features % 16 == 0)


def apply_float8(model: nn.Module, recipe: str, device) -> nn.Module:
    """Convert ``model``'s Linear layers to torchao's float8 training layers with ``recipe``
    scaling, in place; returns the model. Refuses where it cannot run (``check_float8``)."""
    check_float8(recipe, device)
    # Deferred: torchao is optional, imported only when the lever is asked for.
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional
    config = Float8LinearConfig.from_recipe_name(recipe)
    converted = convert_to_float8_training(model, config=config,
                                           module_filter_fn=_float8_shaped)
    return converted
