"""A rung's training steps as one callable: the hand-written plain loop, or ``accelerate``'s
step for the rung's levers. ``kasoku bench``'s worker times it, ``kasoku scale``'s workers and
``kasoku data bench``'s model side run it, and the probes under ``research/probes`` profile it.
"""
from __future__ import annotations

import functools

from kasoku.accel.compose import accelerate
from kasoku.commands.bench import plain
from kasoku.commands.bench.rungs import Rung
from kasoku.optim import make_optimizer


def make_runner(rung: Rung, wl, model, device, lr: float, notes: list[str], distribute=None):
    """The rung's training steps as a ``Runner`` (``kasoku.commands.bench.timing``): one step per
    batch it is given, returning the last loss. The plain rung is the hand-written loop of
    ``kasoku.commands.bench.plain``; every other rung is ``accelerate``'s step for its config. Notes
    of levers skipped on this device are appended to ``notes``. A kasoku rung's runner
    carries its step function as ``step_fn`` (where a profiled window attaches its phase
    marks) and its model as ``model``; the plain loop takes none. ``distribute``: as
    ``accelerate`` takes it (``kasoku scale``'s data-parallel steps)."""
    r = wl.recipe
    if rung.is_plain:
        plain.setup_backends()
        optimizer = plain.make_optimizer(r, model.parameters(), lr)
        return functools.partial(plain.train_steps, model, optimizer, loss_fn=wl.loss_fn,
                                 grad_clip=r.grad_clip)

    def build_optimizer(params, impl):
        return make_optimizer(r.optimizer, params, lr, momentum=r.momentum,
                              weight_decay=r.weight_decay, impl=impl)

    # No metric: the plain rung computes none, and each rung must do the same arithmetic for
    # its rate to be read against plain's (the accuracy is the trainer's reporting, not part
    # of the training step being timed).
    # The recipe's clipping too: every rung, plain's included, times the step train runs.
    acc = accelerate(model, wl.loss_fn, None, rung.config, device, build_optimizer,
                     distribute=distribute, grad_clip=r.grad_clip)
    notes.extend(acc.notes)
    acc.model.train()
    step_fn, acc_model, optimizer = acc.step_fn, acc.model, acc.optimizer

    def run_steps(batches):
        for batch in batches:
            observation = step_fn(acc_model, batch, optimizer)
        return observation["main/loss"]

    run_steps.step_fn = step_fn
    run_steps.model = acc_model
    return run_steps
