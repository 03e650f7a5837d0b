"""LAMB: layer-wise adaptive moments for large-batch training (You et al. 2019)."""
from __future__ import annotations

import torch

from kasoku.optim import _layerwise as lw


class LAMB(lw.LayerwiseOptimizer):
    """Adam's bias-corrected moments, then each tensor's step scaled by its trust ratio
    (Algorithm 2 of the paper, with phi the identity; weight decay decoupled, in the update)::

        m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g**2
        u = m / (1 - beta1**t) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w
        w = w - lr * trust * u,   trust = ||w|| / ||u||   (1 if either norm is 0)

    ``exclude_bias_and_norm``: 1-d tensors (biases, norm weights) get neither weight decay nor
    a trust ratio (an Adam step). ``foreach``: multi-tensor kernels (default) or one kernel
    per tensor per op. Step counts are 0-dim tensors on the parameters' device, ``lr`` may be
    one too: no host reads, so the step can be captured in a CUDA graph (``graph_safe``).
    AMP: ``found_inf`` / ``grad_scale`` attributes as in ``LARS`` (sync-free skip).
    """
    def __init__(self, params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, exclude_bias_and_norm: bool = False,
                 foreach: bool = True):
        lw.check_lr(lr)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps < 0 or weight_decay < 0:
            raise ValueError(f"LAMB needs betas in [0, 1), eps >= 0 and weight_decay >= 0, got "
                             f"{betas}, {eps}, {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        exclude_bias_and_norm=exclude_bias_and_norm, foreach=foreach)
        super().__init__(params, defaults)

    def _update(self, group, params, grads, states, adapt, keep) -> None:
        beta1, beta2 = group["betas"]
        _lamb_update(params, grads, [state["exp_avg"] for state in states],
                     [state["exp_avg_sq"] for state in states],
                     [state["step"] for state in states], lr=group["lr"], beta1=beta1,
                     beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"] if adapt else 0.0,
                     adapt=adapt, keep=keep)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def _lamb_update(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                 weight_decay, adapt: bool, keep) -> None:
    if keep is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # One add per 0-dim step counter: foreach add of a device-tensor scalar to 0-dim
        # tensors failed under CUDA graph capture (torch 2.11).
        for step in steps:
            step.add_(keep)
    torch._foreach_mul_(exp_avgs, lw.hold_when_skipped(beta1, keep))
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, lw.hold_when_skipped(beta2, keep))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    # A step skipped before any update has t = 0; its (zero) update must not divide by 0.
    t = torch.stack(steps).clamp_min(1.0)
    bias_correction1 = 1 - beta1 ** t
    bias_correction2_sqrt = (1 - beta2 ** t).sqrt()
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt.unbind(0))
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    torch._foreach_div_(update, bias_correction1.unbind(0))
    if weight_decay:
        torch._foreach_add_(update, params, alpha=weight_decay)
    if adapt:
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(update))
        trust = lw.trust_ratio(w_norm, u_norm, w_norm / u_norm)
        torch._foreach_mul_(update, (trust * lw.gated(lr, keep)).unbind(0))
    else:
        torch._foreach_mul_(update, lw.gated(lr, keep))
    torch._foreach_sub_(params, update)
