"""Optimizers by name, from a workload's recipe, in the implementation the caller picks
(``make_optimizer``); kasoku's own layer-wise optimizers beside it: ``lars.LARS``,
``lamb.LAMB`` (``_layerwise``: what they share). The Triton Adam stays in ``kasoku.accel``
(``triton_adam``), whose ``accelerate`` compiles its kernels early."""
from __future__ import annotations

from typing import Iterable

import torch

from kasoku.accel.compile import has_cxx_compiler, import_compiler
from kasoku.accel.config import OPTIMIZER_IMPLS
from kasoku.accel.notes import warn_once
from kasoku.accel.triton_adam import TritonAdam, triton_unavailable_reason
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.kfac import KFAC, KFACConfig
from kasoku.optim.lamb import LAMB
from kasoku.optim.lars import LARS
from kasoku.train.config import OPTIMIZERS

IMPLS = OPTIMIZER_IMPLS
"""loop: one kernel per tensor per op; foreach: multi-tensor kernels; fused: one kernel for all
weights (torch's ``fused=True``; SGD, momentum, Adam and AdamW only); compiled: the foreach
update compiled by ``torch.compile`` (SGD, momentum, Adam and AdamW; see ``compile_step``);
triton: Adam as one Triton kernel over all weights with a full grid
(``kasoku.accel.triton_adam``; where it cannot run -- a CPU, no Triton -- the update is fused
or foreach, warned once)."""


def make_optimizer(name: str, params: Iterable, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0, impl: str | None = None,
                   model: torch.nn.Module | None = None, kfac=None,
                   betas: tuple[float, float] | None = None) -> torch.optim.Optimizer:
    """``sgd`` (plain), ``momentum`` (SGD with momentum, as Chainer's MomentumSGD), ``adam``,
    ``adamw`` (Loshchilov & Hutter 2019), ``lars`` (You et al. 2017; ``momentum`` is its
    momentum), ``lamb`` (You et al. 2019) or ``kfac``: K-FAC (``kasoku.kfac.KFAC``)
    preconditioning the gradients of ``model``'s Linear and Conv2d layers in front of the
    optimizer ``kfac.base`` (``kfac``: a ``KFACConfig``, default ``KFACConfig()``: momentum),
    built here with the other arguments.
    ``betas``: adam's and adamw's moment decays (None: torch's, (0.9, 0.999); GPT-2-class
    training takes (0.9, 0.95)); the other optimizers have none.
    ``params``: parameters or parameter groups (dicts), as torch optimizers take them.
    Weight decay is L2 added to the gradient for sgd/momentum/adam/lars (as in the seeds) and
    decoupled for lamb and adamw (their papers); LARS and LAMB exclude biases and normalization
    weights (tensors of one dimension) from weight decay and from the trust ratio, adamw from
    weight decay (``decay_groups``, as GPT-2 and nanoGPT).

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
    if name == "kfac":
        return _make_kfac(params, lr, momentum, weight_decay, impl, model, kfac)
    if name in ("lars", "lamb"):
        return _make_layerwise(name, params, lr, momentum, weight_decay, impl)
    if name == "adamw":
        params = decay_groups(params, weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(name, torch.optim.SGD)
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if betas is not None and name in ("adam", "adamw"):
        kwargs["betas"] = tuple(betas)
    if name == "momentum":
        kwargs["momentum"] = momentum
    if impl is None:
        impl = "fused" if _fused_available(params) else "foreach"
    if impl == "triton":
        if name != "adam":
            raise ConfigError(f"{flag('accel.optimizer_impl')} triton implements adam only, not "
                              f"{name}; use {flag('accel.optimizer_impl')} fused or compiled")
        tensors = [p for g in params for p in g["params"]] \
            if params and isinstance(params[0], dict) else params
        reason = triton_unavailable_reason(tensors)
        if reason is None:
            return TritonAdam(params, **kwargs)
        # A lever that cannot apply here (a CPU, no Triton) is skipped, said once.
        impl = "fused" if _fused_available(params) else "foreach"
        warn_once(f"optimizer_impl triton: {reason}; the update runs as the {impl} "
                  f"implementation")
    if impl == "compiled":
        return compile_step(cls(params, foreach=True, fused=False, **kwargs))
    if impl == "fused":
        if not _fused_available(params):
            raise ConfigError(f"fused {name} is not available for these parameters with torch "
                              f"{torch.__version__} (it needs floating-point parameters on "
                              f"{', '.join(_fused_devices())}); use {flag('accel.optimizer_impl')} "
                              "foreach")
        return cls(params, fused=True, **kwargs)
    return cls(params, foreach=impl == "foreach", fused=False, **kwargs)


def decay_groups(params: list, weight_decay: float) -> list:
    """Parameter groups: ``weight_decay`` for tensors of two or more dimensions (matrices,
    embeddings), none for biases and normalization weights; ``params`` already in groups
    (dicts) are returned as they are."""
    if not params or isinstance(params[0], dict):
        return params
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _make_layerwise(name: str, params: list, lr: float, momentum: float, weight_decay: float,
                    impl: str | None) -> torch.optim.Optimizer:
    if impl in ("fused", "compiled"):
        raise ConfigError(f"{name} has no {impl} implementation (its trust ratio is per tensor); "
                          f"use {flag('accel.optimizer_impl')} foreach, whose update is "
                          "multi-tensor")
    foreach = impl != "loop"
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                    exclude_bias_and_norm=True, foreach=foreach)
    return LAMB(params, lr=lr, weight_decay=weight_decay, exclude_bias_and_norm=True,
                foreach=foreach)


def _make_kfac(params: list, lr: float, momentum: float, weight_decay: float,
               impl: str | None, model, cfg) -> torch.optim.Optimizer:
    if model is None:
        raise ConfigError("optimizer kfac preconditions the gradients of a model's Linear and "
                          "Conv2d layers: pass the model (make_optimizer(..., model=model))")
    cfg = cfg or KFACConfig()
    cfg.check()
    base = make_optimizer(cfg.base, params, lr, momentum=momentum, weight_decay=weight_decay,
                          impl=impl)
    return KFAC(model, base, cfg)


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


def compile_step(optimizer: torch.optim.Optimizer, backend: str = "inductor"
                 ) -> torch.optim.Optimizer:
    """Replace ``optimizer.step`` by its ``torch.compile``'d version, in place; returns it.

    torch's fused kernels apply the update in chunks of 65,536 elements, one thread block per
    chunk: the MNIST MLP's 1.8M weights make ~28 blocks on a GPU of 132 multiprocessors, and
    its fused Adam takes 72 us (half of the whole step's kernel time) for ~50 MB of traffic.
    Inductor's kernels for the same update cover every element with a full grid. The state,
    ``state_dict`` and hooks stay the optimizer's own; the compiler is imported here and
    compilation happens at the first step (warm-up). Learning rates that change (schedules)
    should be tensors, as a CUDA graph needs them anyway, or every new float value recompiles.
    On a CPU without a C++ compiler, which inductor needs there, the update stays the foreach
    one (warned once). ``backend``: torch.compile's (tests use ``aot_eager``).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if backend == "inductor" and params and params[0].device.type == "cpu":
        if not has_cxx_compiler():
            warn_once("optimizer_impl compiled: inductor needs a C++ compiler on cpu and none is "
                      "on PATH; the update runs as the foreach implementation")
            return optimizer
    import_compiler(backend)  # start-up work, not the first step's
    eager_step = type(optimizer).step

    @torch.compile(fullgraph=False, backend=backend)
    def compiled_step(closure=None):
        return eager_step(optimizer, closure)

    optimizer.step = compiled_step
    return optimizer
