"""``KFACPreconditioner``: hooks on a model's Linear and Conv2d layers that read their inputs and
output gradients, the factors' running averages and eigenbases, and the in-place
preconditioning of the layers' weight gradients. ``kasoku.kfac.optimizer.KFAC`` puts it in
front of a base optimizer.

When things happen, on step ``t`` (``t`` counts ``step`` calls):

- forward (training mode, gradients on), if ``t`` is a factor step (``t % factor_update_freq
  == 0``): each layer's hook computes this batch's ``A`` from its input and registers a hook on
  its output that computes ``G`` from the output's gradient during backward (a tensor hook
  rather than a module's full backward hook, which fails when an in-place ReLU follows the
  layer, as in kasoku's MLP). A layer called twice in one pass gets the mean of both.
- ``step``: on a factor step, the batch's factors enter the running averages (which start at
  the identity, as kfac-pytorch's); on an inverse step (``t % inv_update_freq == 0``) the
  averages are eigendecomposed; then every layer with an eigenbasis has its gradient replaced
  by the preconditioned one, all of them scaled by the KL clip.

With data-parallel workers (a process group of more than one, ``kasoku.distributed.ddp.active``),
the batch statistics are averaged over the workers before they enter the running averages, and on
inverse steps each worker eigendecomposes its share of the factors and sends the eigenbases to the
others (``kasoku.kfac.distributed``): every worker holds the same factors and eigenbases, and
preconditions DDP's averaged gradients into the same update. Give it the module inside
``DistributedDataParallel`` (the hooks go on its layers).

Each training forward pass of the whole model starts over: the statistics of a pass whose step
never ran (a loss-scaled step skipped for an overflow) are dropped, not mixed into the next.
So with gradient accumulation over several passes, only the last pass's factors count.

Its work is timed as phases of its own (``kasoku.kfac.phases``) when a
phase clock's ``mark`` is given (``mark``; kasoku's Updater gives it the one the step takes):
``kfac_factors`` in the hooks and for the running averages, ``kfac_inverse``,
``kfac_precondition``; each hands back to the phase it interrupted (forward, backward,
update). The default, ``no_mark``, costs one call per hook.

Under fp16 with loss scaling, output gradients are scaled: ``loss_scale`` (a number, a 0-dim
tensor, or a callable returning either: the scale of the current backward pass) divides ``G``
by its square. kasoku's ``accelerate`` sets it to its loss scaler's scale tensor.

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.core.phases import no_mark
from kasoku.distributed import ddp
from kasoku.kfac import distributed, eigen, factors
from kasoku.kfac.config import KFACConfig
from kasoku.kfac.phases import FACTORS, INVERSE, PRECONDITION

_STATE_KEYS = ("A", "G", "QA", "LA", "QG", "LG")
"""A layer's state in a state dict: the two running factors, then per factor either its
eigenvectors and (clamped) eigenvalues (the eigen method) or its damped inverse in ``Q`` and
None in ``L`` (the inverse method). They are saved, not recomputed: between inverse steps
they lag the factors, and an exact resume needs the ones in use."""


class KFACLayer:
    """One preconditioned layer: this step's batch statistics, the running factors, the
    eigenbases (all float32, on the layer's device). ``bias``: the layer's bias is
    preconditioned with its weight (the gradient matrix's last column)."""

    def __init__(self, name: str, module: nn.Module, bias: bool):
        self.name, self.module, self.bias = name, module, bias
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        self.state: dict[str, torch.Tensor | None] = dict.fromkeys(_STATE_KEYS)

    def __repr__(self) -> str:
        return f"KFACLayer({self.name!r}, {type(self.module).__name__}, bias={self.bias})"

    def add_a(self, a: torch.Tensor) -> None:
        self.a_sum = a if self.a_sum is None else self.a_sum + a
        self.a_count += 1

    def add_g(self, g: torch.Tensor) -> None:
        self.g_sum = g if self.g_sum is None else self.g_sum + g
        self.g_count += 1

    def clear_batch(self) -> None:
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0

    def update_factors(self, decay: float) -> None:
        """Fold this step's statistics into the running averages (new tensors: a state dict
        taken earlier keeps its values)."""
        for key, total, count in (("A", self.a_sum, self.a_count),
                                  ("G", self.g_sum, self.g_count)):
            if total is None:
                continue
            old = self.state[key]
            if old is None:
                old = torch.eye(total.shape[0], dtype=total.dtype, device=total.device)
            self.state[key] = old * decay + total * ((1.0 - decay) / count)
        self.clear_batch()

    def update_inverse(self, method: str, damping: float) -> None:
        """Eigendecompose (or invert, by ``method``) both running factors, once both exist."""
        s = self.state
        if s["A"] is None or s["G"] is None:
            return
        try:
            for key in "AG":
                s["L" + key], s["Q" + key] = eigen.invert(s[key], method, damping)
        except eigen.EighError as exc:
            raise eigen.EighError(
                f"K-FAC: the factors of layer {self.name!r} cannot be decomposed, in "
                f"float32 nor in float64 ({exc}); they hold inf or nan: training diverged. "
                f"Lower {flag('train.lr')} or raise {flag('kfac.damping')}") from None

    def precondition(self, g: torch.Tensor, method: str, damping: float) -> torch.Tensor:
        """The preconditioned gradient matrix of the gradient matrix ``g``."""
        s = self.state
        if method == "inverse":
            return s["QG"] @ g @ s["QA"]
        return eigen.precondition(g, s["QA"], s["LA"], s["QG"], s["LG"], damping)

    @property
    def ready(self) -> bool:
        return self.state["QA"] is not None

    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as ``[out, in (+1)]`` in float32, or None without one this step."""
        w, b = self.module.weight, self.module.bias
        if w.grad is None or (self.bias and b.grad is None):
            return None
        g = w.grad.reshape(w.shape[0], -1).float()
        if self.bias:
            g = torch.cat([g, b.grad.float().unsqueeze(1)], dim=1)
        return g

    def set_grad(self, v: torch.Tensor) -> None:
        """Write ``v`` (``grad_matrix``'s shape) into the gradients, in place (their layout,
        channels_last included, and dtype stay)."""
        w = self.module.weight
        cols = w[0].numel()
        w.grad.copy_(v[:, :cols].reshape(w.shape))
        if self.bias:
            self.module.bias.grad.copy_(v[:, cols])

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        device = self.module.weight.device
        self.state = {key: None if state[key] is None else
                      state[key].to(device=device, dtype=torch.float32) for key in _STATE_KEYS}
        self.clear_batch()


class KFACPreconditioner:
    """K-FAC for ``model``'s layers whose weights are in ``params`` (the base optimizer's;
    frozen layers and those the optimizer does not hold are left out), configured by
    ``config``. ``step(lr_of)`` preconditions their gradients in place; ``lr_of(weight)`` is
    the learning rate of the group holding ``weight``, for the KL clip. Layers it cannot
    precondition (batch norm, embeddings, grouped convolutions, anything but Linear and
    Conv2d) keep their gradients. ``remove()`` takes the hooks off the model.

    ``mark``: a phase clock's mark (see the module doc), ``no_mark`` by default."""

    def __init__(self, model: nn.Module, params, config: KFACConfig | None = None,
                 loss_scale=None):
        self.config = config or KFACConfig()
        self.config.check()
        self.loss_scale = loss_scale
        self.mark = no_mark
        self.steps = 0
        self._owners = None  # (the factors' sizes and the workers, who decomposes what)
        held = {id(p) for p in params}
        self.layers: dict[str, KFACLayer] = {}
        grouped = []
        for name, module in model.named_modules():
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            if not factors.supported(module):
                grouped.append(name)
                continue
            w, b = module.weight, module.bias
            if not w.requires_grad or id(w) not in held:
                continue
            bias = b is not None and b.requires_grad and id(b) in held
            self.layers[name] = KFACLayer(name, module, bias)
        if grouped:
            warn_once(f"K-FAC: {len(grouped)} convolution{'s' * (len(grouped) > 1)} with "
                      f"groups > 1 ({', '.join(grouped[:3])}{', ...' * (len(grouped) > 3)}) "
                      f"left to the base optimizer: their factors are not implemented")
        if not self.layers:
            raise ConfigError("K-FAC found no layer to precondition: the model has no "
                              "nn.Linear or nn.Conv2d (groups 1) whose weight is trainable and "
                              "held by the optimizer; use another optimizer")
        by_module = {layer.module: layer for layer in self.layers.values()}
        self._handles = [model.register_forward_pre_hook(self._begin_pass)]
        self._handles += [module.register_forward_hook(functools.partial(self._read_input, layer))
                          for module, layer in by_module.items()]

    def __repr__(self) -> str:
        return f"KFACPreconditioner({len(self.layers)} layers, {self.config})"

    # --- hooks ---------------------------------------------------------------------------
    def _capturing(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() \
            and self.steps % self.config.factor_update_freq == 0

    def _begin_pass(self, model, args) -> None:
        if self._capturing(model):
            for layer in self.layers.values():
                layer.clear_batch()

    def _read_input(self, layer: KFACLayer, module, args, output) -> None:
        if not args or not self._capturing(module):
            return
        was = self.mark(FACTORS)
        # Outside autocast: the factors are float32 products whatever the training dtype.
        with torch.no_grad(), torch.autocast(output.device.type, enabled=False):
            layer.add_a(factors.a_factor(module, args[0], layer.bias,
                                          self.config.factor_precision))
        if output.requires_grad:
            output.register_hook(functools.partial(self._read_grad, layer))
        if was is not None:
            self.mark(was)  # back to forward

    def _read_grad(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        # On a GPU this runs on autograd's device thread; the clock is not locked, which is
        # safe because the training thread waits inside backward() meanwhile.
        was = self.mark(FACTORS)
        with torch.no_grad(), torch.autocast(grad.device.type, enabled=False):
            g = factors.g_factor(layer.module, grad, self.config.factor_precision)
            scale = self.loss_scale() if callable(self.loss_scale) else self.loss_scale
            if scale is not None:
                g = g / (scale * scale)  # a device tensor divides without a sync
            layer.add_g(g)
        if was is not None:
            self.mark(was)  # back to backward

    # --- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr_of: Callable[[torch.Tensor], float | torch.Tensor]) -> None:
        """Update factors and eigenbases when due, then precondition the gradients in place.
        Call it after backward (and after unscaling the gradients), before the base
        optimizer's step."""
        cfg, mark = self.config, self.mark
        parallel = ddp.active()
        was = None  # the phase this step interrupted (update), handed back at the end
        if self.steps % cfg.factor_update_freq == 0:
            was = mark(FACTORS)
            if parallel:
                self._average_batch_factors()
            for layer in self.layers.values():
                layer.update_factors(cfg.factor_decay)
        if self.steps % cfg.inv_update_freq == 0:
            interrupted = mark(INVERSE)
            was = was or interrupted
            if parallel:
                self._share_eigenbases()
            else:
                for layer in self.layers.values():
                    layer.update_inverse(cfg.method, cfg.damping)
        interrupted = mark(PRECONDITION)
        was = was or interrupted
        self._precondition(lr_of)
        self.steps += 1
        if was is not None:
            mark(was)

    def _precondition(self, lr_of) -> None:
        """Replace each ready layer's gradient by its preconditioned one, KL-clipped."""
        cfg = self.config
        updates, vg = [], None
        for layer in self.layers.values():
            g = layer.grad_matrix() if layer.ready else None
            if g is None:
                continue
            v = layer.precondition(g, cfg.method, cfg.damping)
            updates.append((layer, v))
            if cfg.kl_clip is not None:
                term = (v * g).sum() * lr_of(layer.module.weight) ** 2
                vg = term if vg is None else vg + term
        scale = eigen.kl_scale(vg, cfg.kl_clip) if vg is not None else None
        for layer, v in updates:
            layer.set_grad(v if scale is None else v * scale)

    # --- data-parallel workers (kasoku.kfac.distributed) ----------------------------------
    def _average_batch_factors(self) -> None:
        """Replace each layer's batch statistics by their mean over the workers. Every worker
        runs the same model on a batch of the same size, so the same layers hold statistics
        on every worker, in the same order: the buffers match."""
        held = [(layer, key) for layer in self.layers.values() for key in "ag"
                if getattr(layer, f"{key}_sum") is not None]
        if not held:
            return
        means = [getattr(layer, f"{key}_sum") / getattr(layer, f"{key}_count")
                 for layer, key in held]
        for (layer, key), mean in zip(held, distributed.average_factors(
                means, self.config.factor_comm_dtype)):
            setattr(layer, f"{key}_sum", mean)
            setattr(layer, f"{key}_count", 1)

    def _share_eigenbases(self) -> None:
        layers = [layer for layer in self.layers.values()
                  if layer.state["A"] is not None and layer.state["G"] is not None]
        if not layers:
            return
        dims = [(layer.state["A"].shape[0], layer.state["G"].shape[0]) for layer in layers]
        key = (tuple(dims), distributed.world_size())
        if self._owners is None or self._owners[0] != key:
            self._owners = (key, distributed.assign(dims, key[1]))
        distributed.share_eigenbases(layers, self._owners[1], self.config.method,
                                     self.config.damping)

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step count and each layer's factors and eigenbases (weights_only-safe)."""
        return {"steps": self.steps, "method": self.config.method,
                "layers": {name: layer.state_dict() for name, layer in self.layers.items()}}

    def load_state_dict(self, state: dict) -> None:
        method = state.get("method", "eigen")
        if method != self.config.method:
            raise ValueError(f"the K-FAC state was made with {flag('kfac.method')} {method}, this "
                             f"run asks for {self.config.method}: resume with "
                             f"{flag('kfac.method')} {method}")
        saved, here = set(state["layers"]), set(self.layers)
        if saved != here:
            raise ValueError(f"the K-FAC state is of other layers (there: "
                             f"{', '.join(sorted(saved - here)) or '-'}; here: "
                             f"{', '.join(sorted(here - saved)) or '-'}): another model")
        for name, layer in self.layers.items():
            layer.load_state_dict(state["layers"][name])
        self.steps = int(state["steps"])

    def remove(self) -> None:
        """Take the hooks off the model (the gradients are then left alone)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
