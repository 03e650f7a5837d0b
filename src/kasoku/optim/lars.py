"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017), momentum form."""
from __future__ import annotations

import torch

from kasoku.optim import _layerwise as lw


class LARS(lw.LayerwiseOptimizer):
    """SGD with momentum where each tensor's step is scaled by its trust ratio (Algorithm 1 of
    the paper; the rate sits inside the momentum, as there and in MLPerf's ResNet-50)::

        trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)   (1 if ||w|| or ||g|| is 0)
        buf   = momentum * buf + lr * trust * (g + weight_decay * w)
        w     = w - buf

    ``exclude_bias_and_norm``: tensors of one dimension (biases, BatchNorm/LayerNorm weights)
    get neither weight decay nor a trust ratio (plain momentum SGD), as in Goyal et al. and
    the LARS ImageNet recipes. ``foreach``: multi-tensor kernels (default) or one kernel per
    tensor per op.

    ``lr`` may be a 0-dim tensor on the parameters' device, updated in place by schedules: the
    step never reads it, nor anything else, on the host, so it can be captured in a CUDA graph
    (``graph_safe``). AMP: with ``found_inf`` set as an attribute (kasoku's LossScaler, torch's
    GradScaler), an overflowing step leaves weights and momentum untouched without a host sync;
    ``grad_scale``, if set, divides the gradients first.
    """
    def __init__(self, params, lr: float | torch.Tensor, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 exclude_bias_and_norm: bool = False, foreach: bool = True):
        lw.check_lr(lr)
        if momentum < 0 or weight_decay < 0 or eps < 0 or not trust_coefficient > 0:
            raise ValueError(f"LARS needs momentum, weight_decay, eps >= 0 and "
                             f"trust_coefficient > 0, got {momentum}, {weight_decay}, {eps}, "
                             f"{trust_coefficient}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps,
                        exclude_bias_and_norm=exclude_bias_and_norm, foreach=foreach)
        super().__init__(params, defaults)

    def _update(self, group, params, grads, states, adapt, keep) -> None:
        _lars_update(params, grads, [state["momentum_buffer"] for state in states],
                     lr=group["lr"], momentum=group["momentum"],
                     weight_decay=group["weight_decay"] if adapt else 0.0,
                     trust_coefficient=group["trust_coefficient"], eps=group["eps"],
                     adapt=adapt, keep=keep)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def _lars_update(params, grads, bufs, *, lr, momentum, weight_decay, trust_coefficient, eps,
                 adapt: bool, keep) -> None:
    d = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else grads
    if adapt:
        w_norm = torch.stack(torch._foreach_norm(params))
        g_norm = torch.stack(torch._foreach_norm(grads))
        trust = lw.trust_ratio(w_norm, g_norm,
                               trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps))
        scaled = torch._foreach_mul(d, (trust * lw.gated(lr, keep)).unbind(0))
    else:
        scaled = torch._foreach_mul(d, lw.gated(lr, keep))
    torch._foreach_mul_(bufs, lw.hold_when_skipped(momentum, keep))
    torch._foreach_add_(bufs, scaled)
    torch._foreach_sub_(params, bufs if keep is None else torch._foreach_mul(bufs, keep))
