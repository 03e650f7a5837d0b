"""What LARS and LAMB share: gradient preparation (unscaling, sync-free skipping) and the
split of a parameter group into the tensors that get a trust ratio and those that do not."""
from __future__ import annotations

import torch


def prepare_grads(grads: list[torch.Tensor], grad_scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``(grads, keep)``. ``grad_scale`` (set by torch's GradScaler) divides the gradients.
    With ``found_inf`` (1.0: this step overflowed), ``keep = 1 - found_inf`` and the gradients
    are zeroed where non-finite and multiplied by ``keep``: the update math then stays finite,
    and multiplying the update by ``keep`` (and holding the moment decay at 1) leaves weights
    and state bit-identical on a skipped step. That is how the skip happens on the device,
    without reading ``found_inf`` on the host. ``keep`` is None without ``found_inf``."""
    if grad_scale is not None:
        grads = torch._foreach_div(grads, grad_scale)
    if found_inf is None:
        return grads, None
    keep = 1.0 - found_inf
    # nan_to_num has no multi-tensor form: one kernel per tensor, only on loss-scaled steps.
    grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    torch._foreach_mul_(grads, keep)
    return grads, keep


def hold_when_skipped(decay: float, keep: torch.Tensor | None):
    """A moment's decay factor: ``decay``, or 1 on a skipped step (``keep == 0``)."""
    return decay if keep is None else torch.where(keep > 0, decay, 1.0)


def gated(lr, keep: torch.Tensor | None):
    """The learning rate times ``keep`` (0 on a skipped step); float or 0-dim tensor."""
    return lr if keep is None else lr * keep


def batches(params: list[torch.Tensor], exclude_bias_and_norm: bool, foreach: bool
            ) -> list[tuple[list[int], bool]]:
    """Index lists that share one update call, each with whether its tensors get the trust
    ratio and weight decay (False for 1-d tensors, biases and norm weights, when excluded).
    foreach: at most two calls for the whole group; loop: one call per tensor, so every op
    runs one kernel per tensor (the same math, in the loop implementation's kernel count)."""
    adapt = [not (exclude_bias_and_norm and p.ndim <= 1) for p in params]
    if not foreach:
        return [([i], a) for i, a in enumerate(adapt)]
    out = []
    for flag in (True, False):
        idx = [i for i, a in enumerate(adapt) if a == flag]
        if idx:
            out.append((idx, flag))
    return out


def trust_ratio(numerator_norms: torch.Tensor, denominator_norms: torch.Tensor,
                ratio: torch.Tensor) -> torch.Tensor:
    """``ratio`` where both norms are positive, else 1 (a zero weight or update: no scaling)."""
    return torch.where((numerator_norms > 0) & (denominator_norms > 0), ratio, 1.0)


def check_lr(lr) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("a tensor learning rate must have one element")
    elif not lr > 0:
        raise ValueError(f"learning rate must be positive, got {lr}")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """The step shared by LARS and LAMB: per group, the tensors with gradients, their state
    (``self._state(p)``), the gradients unscaled and masked for a skipped AMP step, then
    ``self._update(group, params, grads, states, adapt, keep)`` per batch of tensors that
    share ``adapt`` (trust ratio and weight decay, or neither for excluded 1-d tensors)."""
    graph_safe = True

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            grads, keep = prepare_grads([p.grad for p in params],
                                        getattr(self, "grad_scale", None),
                                        getattr(self, "found_inf", None))
            for idx, adapt in batches(params, group["exclude_bias_and_norm"], group["foreach"]):
                self._update(group, [params[i] for i in idx], [grads[i] for i in idx],
                             [states[i] for i in idx], adapt, keep)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        raise NotImplementedError

    def _update(self, group: dict, params: list, grads: list, states: list, adapt: bool,
                keep) -> None:
        raise NotImplementedError
