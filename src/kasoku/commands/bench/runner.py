"""A rung's training steps as one callable: the hand-written plain loop, or ``accelerate``'s
step for the rung's levers. ``kasoku bench``'s worker times it, ``kasoku scale``'s workers and
``kasoku data bench``'s model side run it, and the probes under ``research/probes`` profile it.
"""
from __future__ import annotations

import functools

import torch

from kasoku.accel.compose import accelerate
from kasoku.commands.bench import plain
from kasoku.commands.bench.rungs import Rung
from kasoku.distributed.fsdp import Distribute
from kasoku.optim import make_optimizer
from kasoku.train.step import Step


class StepRunner:
    """A kasoku rung's ``Runner``: ``step`` (``accelerate``'s, where a profiled window attaches
    its phase marks) on each batch it is given, on ``model`` and ``optimizer``; returns the
    last step's loss."""

    def __init__(self, step: Step, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.step, self.model, self.optimizer = step, model, optimizer

    def __call__(self, batches):
        for batch in batches:
            observation = self.step(self.model, batch, self.optimizer)
        return observation["main/loss"]


def make_runner(rung: Rung, wl, model, device, lr: float, notes: list[str],
                distribute: Distribute | None = None):
    """The rung's training steps as a ``Runner`` (``kasoku.commands.bench.timing``): one step per
    batch it is given, returning the last loss. The plain rung is the hand-written loop of
    ``kasoku.commands.bench.plain``; every other rung is ``accelerate``'s step for its config. Notes
    of levers skipped on this device are appended to ``notes``. A kasoku rung's runner is a
    ``StepRunner``, its step function and model named; the plain loop has none. ``distribute``: as
    ``accelerate`` takes it (``kasoku scale``'s data-parallel steps)."""
    r = wl.recipe
    if rung.is_plain:
        plain.setup_backends()
        optimizer = plain.make_optimizer(r, model.parameters(), lr)
        return functools.partial(plain.train_steps, model, optimizer, loss_fn=wl.loss_fn,
                                 grad_clip=r.grad_clip)

    def build_optimizer(params, impl):
        return make_optimizer(r.optimizer, params, lr, momentum=r.momentum, betas=r.betas,
                              weight_decay=r.weight_decay, impl=impl)

    # No metric: the plain rung computes none, and each rung must do the same arithmetic for
    # its rate to be read against plain's (the accuracy is the trainer's reporting, not part
    # of the training step being timed).
    # The recipe's clipping too: every rung, plain's included, times the step train runs.
    acc = accelerate(model, wl.loss_fn, None, rung.config, device, build_optimizer,
                     distribute=distribute, grad_clip=r.grad_clip)
    notes.extend(acc.notes)
    acc.model.train()
    return StepRunner(acc.step_fn, acc.model, acc.optimizer)
