"""Optimizers by name, from a workload's recipe, in the implementation the caller picks."""
from __future__ import annotations

from typing import Iterable

import torch

from kasoku.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam", "lars", "lamb")
IMPLS = ("loop", "foreach", "fused")
"""loop: one kernel per tensor per op; foreach: multi-tensor kernels; fused: one kernel for all
weights (torch's ``fused=True``; SGD, momentum and Adam only)."""


def make_optimizer(name: str, params: Iterable, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0, impl: str | None = None) -> torch.optim.Optimizer:
    """``sgd`` (plain), ``momentum`` (SGD with momentum, as Chainer's MomentumSGD), ``adam``,
    ``lars`` (You et al. 2017; ``momentum`` is its momentum) or ``lamb`` (You et al. 2019).
    ``params``: parameters or parameter groups (dicts), as torch optimizers take them.
    Weight decay is L2 added to the gradient for sgd/momentum/adam/lars (as in the seeds) and
    decoupled for lamb (its paper); LARS and LAMB exclude biases and normalization weights
    (tensors of one dimension) from weight decay and from the trust ratio.

    ``impl``: ``loop``, ``foreach``, ``fused`` (seed 004's batched weight update), or None for
    fused where this PyTorch has it for the parameters' device and dtype, foreach otherwise.
    On a 2-core CPU the fused Adam step of the MNIST MLP takes half the time of the default one.
    LARS and LAMB have loop and foreach implementations (their per-tensor trust ratio has no
    fused kernel in torch); ``fused`` for them is refused."""
    if not lr > 0:
        raise ConfigError(f"learning rate must be positive, got {lr}")
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if impl is not None and impl not in IMPLS:
        raise ConfigError(f"unknown optimizer implementation {impl!r}; choose one of "
                          f"{', '.join(IMPLS)} (or leave it unset for the fastest available)")
    params = list(params)
    if name in ("lars", "lamb"):
        return _make_layerwise(name, params, lr, momentum, weight_decay, impl)
    cls = torch.optim.Adam if name == "adam" else torch.optim.SGD
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if name == "momentum":
        kwargs["momentum"] = momentum
    if impl is None:
        impl = "fused" if _fused_available(params) else "foreach"
    if impl == "fused":
        if not _fused_available(params):
            raise ConfigError(f"fused {name} is not available for these parameters with torch "
                              f"{torch.__version__} (it needs floating-point parameters on "
                              f"{', '.join(_fused_devices())}); use --optimizer-impl foreach")
        return cls(params, fused=True, **kwargs)
    return cls(params, foreach=impl == "foreach", fused=False, **kwargs)


def _make_layerwise(name: str, params: list, lr: float, momentum: float, weight_decay: float,
                    impl: str | None) -> torch.optim.Optimizer:
    from kasoku.accel.lamb import LAMB
    from kasoku.accel.lars import LARS
    if impl == "fused":
        raise ConfigError(f"{name} has no fused implementation (its trust ratio is per tensor); "
                          f"use --optimizer-impl foreach, whose update is multi-tensor")
    foreach = impl != "loop"
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                    exclude_bias_and_norm=True, foreach=foreach)
    return LAMB(params, lr=lr, weight_decay=weight_decay, exclude_bias_and_norm=True,
                foreach=foreach)


def _fused_devices() -> list[str]:
    try:  # private, but the list torch itself checks fused parameters against
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return list(_get_fused_kernels_supported_devices())
    except ImportError:
        return ["cuda", "cpu"]


def _fused_available(params: list) -> bool:
    """Whether torch's fused SGD/Adam take these parameters (a group dict's params count)."""
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) \
        else params
    devices = _fused_devices()
    return bool(tensors) and all(torch.is_floating_point(p) and p.device.type in devices
                                 for p in tensors)
