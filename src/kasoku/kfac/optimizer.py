"""``KFAC``: K-FAC in front of a base optimizer, as one ``torch.optim.Optimizer``; and
``check_levers``, the levers it refuses.

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.kfac.config import KFACConfig
from kasoku.kfac.phases import PHASES
from kasoku.kfac.preconditioner import KFACPreconditioner


class KFAC(torch.optim.Optimizer):
    """``step()`` preconditions the gradients of ``model``'s Linear and Conv2d layers held by
    ``base`` (``KFACPreconditioner``), then runs ``base.step()``; every other parameter (batch
    norm, embeddings, grouped convolutions) gets its plain gradient. Build it after the model's
    layers are final (after any layer swaps) and before training::

        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = KFAC(model, base, KFACConfig(damping=0.003))

    ``param_groups``, ``state`` and ``defaults`` are the base optimizer's own objects, so
    learning-rate schedules and loss scalers work through either. ``state_dict`` holds the
    base optimizer's state and K-FAC's (step count, factors, eigenbases): a resume is exact.
    ``loss_scale``: the loss scale of fp16 training (see ``KFACPreconditioner``; not named
    ``grad_scale``, the attribute torch's GradScaler sets on optimizers that divide the
    gradients by it). kasoku's ``accelerate`` sets it to its loss scaler's scale.

    ``mark``: the preconditioner's phase mark (kasoku's Updater sets it to its phase clock's:
    K-FAC's work is timed as ``phases``: ``kfac_factors``, ``kfac_inverse`` and
    ``kfac_precondition``, ``kasoku.kfac.phases``); ``cycle_steps``: the steps after which
    its schedule of factor and inverse steps repeats.

    The step reads nothing on the host except in ``eigh`` on inverse steps; it cannot be
    captured in a CUDA graph (inverse and factor steps differ from the others), and the hooks
    need the model to run eagerly (``check_levers``)."""

    phases: tuple[str, ...] = PHASES
    """The phases K-FAC's work is timed as (``kasoku.kfac.phases``)."""

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer,
                 config: KFACConfig | None = None, loss_scale=None):
        # Not Optimizer.__init__: the groups and the state stay the base optimizer's objects
        # (the properties below); only the step-hook machinery of a torch optimizer is set up.
        self.base = base
        self.preconditioner = KFACPreconditioner(
            model, [p for group in base.param_groups for p in group["params"]], config,
            loss_scale=loss_scale)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    param_groups = property(lambda self: self.base.param_groups,
                            lambda self, value: setattr(self.base, "param_groups", value))
    state = property(lambda self: self.base.state,
                     lambda self, value: setattr(self.base, "state", value))
    defaults = property(lambda self: self.base.defaults,
                        lambda self, value: setattr(self.base, "defaults", value))

    @property
    def config(self) -> KFACConfig:
        return self.preconditioner.config

    @property
    def mark(self):
        return self.preconditioner.mark

    @mark.setter
    def mark(self, value) -> None:
        self.preconditioner.mark = value

    @property
    def cycle_steps(self) -> int:
        """A window of a whole number of these steps holds factor and inverse steps at their
        rates (``kasoku profile`` measures one)."""
        c = self.config
        return math.lcm(c.factor_update_freq, c.inv_update_freq)

    @property
    def loss_scale(self):
        return self.preconditioner.loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        self.preconditioner.loss_scale = value

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs = {id(p): group["lr"] for group in self.param_groups for p in group["params"]}
        self.preconditioner.step(lambda weight: lrs[id(weight)])
        self.base.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Adds to the base optimizer; the new parameters are not preconditioned."""
        self.base.add_param_group(param_group)

    def state_dict(self) -> dict:
        return {"base": self.base.state_dict(), "kfac": self.preconditioner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"base", "kfac"}:
            raise ValueError("the optimizer state is not K-FAC's (it holds no K-FAC factors): "
                             "resume with the optimizer the run was trained with")
        self.preconditioner.load_state_dict(state_dict["kfac"])
        self.base.load_state_dict(state_dict["base"])

    def __repr__(self) -> str:
        c = self.config
        return (f"KFAC({type(self.base).__name__}, {len(self.preconditioner.layers)} layers, "
                f"damping={c.damping:g}, factor_decay={c.factor_decay:g}, kl_clip={c.kl_clip}, "
                f"factor_update_freq={c.factor_update_freq}, "
                f"inv_update_freq={c.inv_update_freq})")


def check_levers(accel) -> None:
    """Refuse what K-FAC cannot run with (``accel``: an ``AccelConfig``), saying what to do
    instead. Data-parallel workers are fine: K-FAC averages its factors over them
    (``kasoku.kfac.distributed``)."""
    if accel.cuda_graph:
        raise ConfigError(f"{flag('accel.cuda_graph')} with {flag('train.optimizer')} kfac: "
                          "K-FAC's factor and inverse steps differ from the other steps and its "
                          "eigendecompositions wait for the device, which one captured step "
                          f"cannot hold; leave out {flag('accel.cuda_graph')}")
    if accel.compile:
        raise ConfigError(f"{flag('accel.compile')} with {flag('train.optimizer')} kfac: K-FAC's "
                          "hooks read each layer's input and output gradient in eager mode; leave "
                          f"out {flag('accel.compile')} ({flag('accel.optimizer_impl')} compiled "
                          "still compiles the base optimizer's update)")
    if accel.precision == "fp16-pure":
        raise ConfigError(f"{flag('accel.precision')} fp16-pure with {flag('train.optimizer')} "
                          "kfac: the optimizer holds fp32 master copies of the weights, whose "
                          f"gradients K-FAC does not see; use {flag('accel.precision')} fp16 or "
                          "bf16")
