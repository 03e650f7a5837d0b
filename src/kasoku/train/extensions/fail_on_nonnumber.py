"""FailOnNonNumber: stop a diverged run with an error naming what went NaN/Inf."""
from __future__ import annotations

import torch

from kasoku.core.errors import NonFiniteError
from kasoku.train.reporter import PRIORITY_EDITOR


class FailOnNonNumber:
    """When its trigger fires, checks that the current loss (``main/loss``) and every
    parameter of the trainer's model are finite, and raises ``NonFiniteError`` naming the first
    that is not.

    The check costs one host sync (all flags are reduced on the device first), so it runs at a
    trigger, by default once per epoch like LogReport's default interval; give it the log
    interval with ``trainer.extend(FailOnNonNumber(), trigger=log_trigger)``, and on the
    run's last iteration. It runs before the snapshot of the same iteration, so a diverged
    state is not written over a good one.
    """
    trigger = (1, "epoch")
    priority = PRIORITY_EDITOR
    name = "FailOnNonNumber"
    at_end = True
    """Checks the last iteration too, so the run's last snapshot is never of a diverged model."""

    def __init__(self, loss_key: str = "main/loss"):
        self.loss_key = loss_key

    def __call__(self, trainer) -> None:
        # A sharded model's parameters (DTensors): this worker's shards; the loss, computed
        # from whole parameters, is non-finite on every worker alike.
        named = [(f"parameter {n!r}", getattr(p, "to_local", lambda p=p: p)())
                 for n, p in trainer.model.named_parameters()]
        loss = trainer.updater.observation.get(self.loss_key)
        if loss is not None:
            named.insert(0, (f"the loss ({self.loss_key})", torch.as_tensor(loss)))
        if not named:
            return
        device = named[0][1].device
        flags = torch.stack([torch.isfinite(t.detach()).all().to(device) for _, t in named])
        # note: this .all().item() is a CPU-GPU sync point, once per trigger.
        if bool(flags.all()):
            return
        what = named[int(torch.nonzero(~flags)[0])][0]
        u = trainer.updater
        raise NonFiniteError(f"{what} is NaN or Inf at iteration {u.iteration} "
                             f"(epoch {u.epoch_detail:.2f}): training diverged; lower the "
                             f"learning rate, add warmup or gradient clipping, or check the "
                             f"data for NaNs")
