"""Large-batch recipe of Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet
in 1 Hour"): the linear scaling rule plus a gradual warmup (seeds 003, 004).

    lr = linear_scaling_lr(0.1, batch_size=8192)                 # 3.2
    warmup = goyal_warmup_epochs(8192)                            # 5.0
    trainer.extend(LinearWarmup(warmup, inner=StepLR(30)))        # kasoku.train.extensions

kasoku's ``LinearWarmup`` ramps from ``lr / warmup_iterations`` rather than from the
small-batch rate as the paper does; both end at the scaled rate after the warmup epochs.
"""
from __future__ import annotations

from kasoku.core.errors import ConfigError

GOYAL_BASE_BATCH = 256
GOYAL_WARMUP_EPOCHS = 5.0


def linear_scaling_lr(base_lr: float, batch_size: int, base_batch: int = GOYAL_BASE_BATCH
                      ) -> float:
    """Linear scaling rule: when the minibatch is multiplied by k, multiply the learning rate
    by k -- ``base_lr * batch_size / base_batch`` (``base_lr`` is the rate at ``base_batch``;
    0.1 at 256 for ResNet-50 on ImageNet)."""
    if not base_lr > 0 or batch_size < 1 or base_batch < 1:
        raise ConfigError(f"linear scaling needs base_lr > 0 and positive batch sizes, got "
                          f"{base_lr}, {batch_size}, {base_batch}")
    return base_lr * batch_size / base_batch


def goyal_warmup_epochs(batch_size: int, base_batch: int = GOYAL_BASE_BATCH,
                        warmup_epochs: float = GOYAL_WARMUP_EPOCHS) -> float:
    """Epochs of gradual warmup: ``warmup_epochs`` (5 in the paper) when the batch is scaled
    up beyond ``base_batch``, 0 otherwise (the base recipe needs none). For ``LinearWarmup``."""
    if batch_size < 1 or base_batch < 1:
        raise ConfigError(f"batch sizes must be positive, got {batch_size} and {base_batch}")
    return float(warmup_epochs) if batch_size > base_batch else 0.0
