"""Dynamic loss scaling without host syncs, and fp32 master weights for fp16-pure training.

``LossScaler`` is what ``torch.amp.GradScaler`` does, rebuilt so that a whole step can be
captured in a CUDA graph: the scale, the growth tracker, ``found_inf`` and the count of
skipped steps are device tensors updated in place by the same kernels GradScaler uses
(``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch._amp_update_scale_``), and
nothing is read on the host -- with one exception, said where it happens: an optimizer that
cannot skip an update on the device.

How an overflowing step is skipped:

- Optimizers with ``_step_supports_amp_scaling`` (torch's fused SGD/Adam/AdamW, kasoku's LARS
  and LAMB) get ``found_inf`` as an attribute, as GradScaler hands it to them; their kernels
  read it on the device and leave weights and state (momentum, Adam moments and step count)
  untouched when it is 1. Sync-free and capturable.
- Any other optimizer (torch's loop and foreach implementations) would update its state
  (momentum decay, Adam's step count) even from zeroed gradients, so the decision is taken on
  the host: one ``found_inf.item()`` per step, as GradScaler does. Such a step cannot be
  captured in a CUDA graph; ``kasoku.accel.compose`` refuses that combination.
"""
from __future__ import annotations

import torch


class LossScaler:
    """Dynamic loss scale, attached to the step as its update (``StandardStep(update=...)``,
    the protocol of ``kasoku.train.step.PlainUpdate``): ``backward(loss)`` runs the backward
    pass of the scaled loss, ``step(optimizer)`` replaces ``optimizer.step()``. ``step``
    unscales the gradients in place (they are true gradients afterwards), skips the update if
    any is inf/nan, then multiplies the scale by ``backoff_factor`` after an overflow or by
    ``growth_factor`` after ``growth_interval`` consecutive good steps.

    ``master``: ``MasterWeights`` of an fp16 model (fp16-pure): ``step`` then copies the fp16
    gradients into the fp32 masters the optimizer holds, and the updated masters back into the
    fp16 weights.

    ``observation()``: ``main/loss_scale`` (the scale this step's backward used) and
    ``main/skipped_steps`` (skipped steps since the start of training, cumulative; a log line
    shows its mean over the interval), both fresh 0-dim device tensors.
    """

    def __init__(self, device, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 master: "MasterWeights | None" = None):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 \
                or growth_interval < 1:
            raise ValueError(f"loss scaling needs init_scale > 0, growth_factor > 1, "
                             f"0 < backoff_factor < 1, growth_interval >= 1; got {init_scale}, "
                             f"{growth_factor}, {backoff_factor}, {growth_interval}")
        device = torch.device(device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.master = growth_interval, master
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._skipped = torch.zeros((), dtype=torch.float32, device=device)
        self._scale_used = self._scale.clone()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self._scale

    def zero_grad(self, model, optimizer) -> None:
        # The model's gradients, not the optimizer's: for fp16-pure it holds fp32 masters,
        # whose gradient buffers ``step`` overwrites.
        model.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.master is not None:
            self.master.grads_to_master()
        self._unscale(_grads(optimizer))
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer's kernels skip the update on the device when found_inf is 1.
            optimizer.found_inf = self._found_inf
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif not self._found_inf.item():  # note: a CPU-GPU sync point (see the module doc)
            optimizer.step()
        if self.master is not None:
            self.master.master_to_model()
        self._update()

    def __repr__(self) -> str:
        return f"LossScaler(master={self.master is not None})"

    def observation(self) -> dict[str, torch.Tensor]:
        # Clones: the reporter keeps these across iterations while the scaler's own tensors
        # change in place.
        return {"main/loss_scale": self._scale_used.clone(),
                "main/skipped_steps": self._skipped.clone()}

    @property
    def scale_value(self) -> torch.Tensor:
        """The current scale (a device tensor; reading it as a float is a sync)."""
        return self._scale

    def _unscale(self, grads: list[torch.Tensor]) -> None:
        self._found_inf.zero_()
        # GradScaler computes the inverse in double, then rounds: same here, same results.
        inv_scale = self._scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, self._found_inf, inv_scale)

    def _update(self) -> None:
        self._scale_used.copy_(self._scale)
        self._skipped.add_(self._found_inf)
        torch._amp_update_scale_(self._scale, self._growth_tracker, self._found_inf,
                                 self.growth_factor, self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        """CPU copies (a sync, at snapshot time), weights_only-safe."""
        return {"scale": self._scale.cpu(), "growth_tracker": self._growth_tracker.cpu(),
                "skipped_steps": self._skipped.cpu()}

    def load_state_dict(self, state: dict) -> None:
        # In place: a captured CUDA graph reads these very tensors.
        self._scale.copy_(state["scale"])
        self._growth_tracker.copy_(state["growth_tracker"])
        self._skipped.copy_(state["skipped_steps"])


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


class MasterWeights:
    """fp32 master copies of a model's fp16 parameters (fp16-pure training).

    ``params``: what the optimizer must update -- a new fp32 leaf tensor for each fp16
    parameter, and parameters that stay fp32 (BatchNorm's) as they are. Each master keeps a
    static ``.grad`` buffer that ``grads_to_master`` copies the fp16 gradients into, so the
    copies are capture-safe; ``master_to_model`` rounds the updated masters into the fp16
    weights (after a skipped step it writes the same values again).
    """

    def __init__(self, model_params):
        self.params: list[torch.Tensor] = []
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in model_params:
            if p.dtype == torch.float16:
                master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                self._pairs.append((p, master))
                self.params.append(master)
            else:
                self.params.append(p)

    @torch.no_grad()
    def grads_to_master(self) -> None:
        src, dst = [], []
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None  # not used this step: the optimizer skips it too
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            src.append(p.grad)
            dst.append(master.grad)
        if src:
            torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def master_to_model(self) -> None:
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def state_dict(self) -> dict:
        """The fp32 masters: neither the model (fp16) nor the optimizer's state dict (which
        holds no parameter values) has them, and a resume without them would lose precision."""
        return {"master": [m.detach().cpu() for _, m in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["master"]
        if len(saved) != len(self._pairs):
            raise ValueError(f"snapshot holds {len(saved)} fp32 master tensors, this model has "
                             f"{len(self._pairs)} fp16 parameters: it is another model")
        for (_, master), value in zip(self._pairs, saved):
            master.copy_(value)
        self.master_to_model()


class PrecisionState:
    """Trainer extension that puts the loss scaler's state (and fp16-pure's fp32 master
    weights) into snapshots, so a resumed run continues with the same scale and weights.
    Register it with ``trainer.extend``; it does nothing during training."""
    trigger = (1, "epoch")
    priority = 0
    name = "PrecisionState"

    def __init__(self, scaler: LossScaler):
        self.scaler = scaler

    def __call__(self, trainer) -> None:
        pass

    def state_dict(self) -> dict:
        state = {"scaler": self.scaler.state_dict()}
        if self.scaler.master is not None:
            state["master"] = self.scaler.master.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        if self.scaler.master is not None and "master" in state:
            self.scaler.master.load_state_dict(state["master"])
