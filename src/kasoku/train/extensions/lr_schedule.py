"""Learning-rate schedules as extensions: the rate is a pure function of the epoch progress.

After every iteration the schedule sets the rate of the next one from
``trainer.updater.epoch_detail`` and the ``initial_lr`` of each parameter group (stored in the
group, as torch schedulers do, so it travels in the optimizer's state dict). No counter of its
own means nothing to drift: a resumed run computes exactly the rates of the uninterrupted one.
Each reports ``lr`` (group 0's rate used by the step just done) as an observation.

One schedule extension per optimizer; to combine warmup with a decay, nest them:
``LinearWarmup(5, inner=CosineLR(90))``.

A group's ``lr`` may be a 0-dim tensor (on the device, as ``kasoku.accel.graph`` makes it for a
captured CUDA graph, which reads the rate from that memory): the schedule then writes it in
place with ``fill_`` (no host sync) and reports a clone of it.
"""
from __future__ import annotations

import math

import torch

from kasoku.train.reporter import PRIORITY_WRITER

_EPS = 1e-9  # same float guard as the triggers: epoch 0.3 with a step of 0.1 is step 3


class LRSchedule:
    """Base class: subclasses implement ``lr_at``."""
    trigger = (1, "iteration")
    priority = PRIORITY_WRITER

    def lr_at(self, base_lr: float, epoch: float, step_epochs: float) -> float:
        """Rate of the iteration that starts at progress ``epoch`` and lasts ``step_epochs``
        (= 1 / batches per epoch)."""
        raise NotImplementedError

    def initialize(self, trainer) -> None:
        for group in trainer.optimizer.param_groups:
            # A float even when lr is a tensor: the tensor changes in place later. (One read
            # of a device tensor here, before training.)
            group.setdefault("initial_lr", float(group["lr"]))
        self._apply(trainer)

    def __call__(self, trainer) -> None:
        lr = trainer.optimizer.param_groups[0]["lr"]
        # A clone: the reporter keeps the value while the tensor is rewritten below.
        trainer.reporter.report({"lr": lr.detach().clone() if isinstance(lr, torch.Tensor)
                                 else lr})
        self._apply(trainer)

    def _apply(self, trainer) -> None:
        u = trainer.updater
        step = 1.0 / u.batches_per_epoch
        for group in trainer.optimizer.param_groups:
            lr = self.lr_at(group["initial_lr"], u.epoch_detail, step)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


class StepLR(LRSchedule):
    """``base_lr * gamma ** floor(epoch / step_size_epochs)``."""
    name = "StepLR"

    def __init__(self, step_size_epochs: float, gamma: float = 0.1):
        if not step_size_epochs > 0:
            raise ValueError(f"step_size_epochs must be positive, got {step_size_epochs}")
        self.step_size_epochs, self.gamma = step_size_epochs, gamma

    def lr_at(self, base_lr: float, epoch: float, step_epochs: float) -> float:
        return base_lr * self.gamma ** math.floor(epoch / self.step_size_epochs + _EPS)


class CosineLR(LRSchedule):
    """Half a cosine from ``base_lr`` at epoch 0 to ``min_lr`` at ``total_epochs`` (held
    after)."""
    name = "CosineLR"

    def __init__(self, total_epochs: float, min_lr: float = 0.0):
        if not total_epochs > 0:
            raise ValueError(f"total_epochs must be positive, got {total_epochs}")
        self.total_epochs, self.min_lr = total_epochs, min_lr

    def lr_at(self, base_lr: float, epoch: float, step_epochs: float) -> float:
        t = min(epoch, self.total_epochs) / self.total_epochs
        return self.min_lr + (base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


class LinearWarmup(LRSchedule):
    """Scales ``inner``'s rate (or the constant ``base_lr``) by ``min(1, end / warmup_epochs)``
    where ``end`` is the progress at the end of the iteration: the first step already trains
    (at ``base_lr / warmup_iterations``), the full rate arrives with the last warmup step."""
    name = "LinearWarmup"

    def __init__(self, warmup_epochs: float, inner: LRSchedule | None = None):
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        self.warmup_epochs, self.inner = warmup_epochs, inner

    def lr_at(self, base_lr: float, epoch: float, step_epochs: float) -> float:
        lr = base_lr if self.inner is None else self.inner.lr_at(base_lr, epoch, step_epochs)
        if self.warmup_epochs == 0:
            return lr
        return lr * min(1.0, (epoch + step_epochs) / self.warmup_epochs)
