"""K-FAC's settings: ``KFACConfig``, whose field docstrings are ``kasoku train``'s help texts
for the ``--kfac-*`` flags.

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

FACTOR_PRECISIONS = ("fp32", "tf32", "bf16")
"""How the factors' products are made (``kasoku.kfac.factors``; ``KFACConfig.factor_precision``).
Here, not there, so that the settings load without torch."""
KFACBase = Literal["momentum", "sgd", "adam"]
KFAC_BASES: tuple[str, ...] = get_args(KFACBase)
"""The optimizers K-FAC can feed its preconditioned gradients to (``KFACConfig.base``)."""

KFACMethod = Literal["eigen", "inverse"]
KFAC_METHODS: tuple[str, ...] = get_args(KFACMethod)
"""How the factors are inverted (``KFACConfig.method``; ``kasoku.kfac.eigen``)."""

KFACCommDtype = Literal["fp32", "bf16", "fp16"]
KFAC_COMM_DTYPES: tuple[str, ...] = get_args(KFACCommDtype)
"""The dtypes of the factors' all-reduce over data-parallel workers
(``KFACConfig.factor_comm_dtype``)."""


@dataclass(frozen=True)
class KFACConfig:
    base: KFACBase = "momentum"
    """The optimizer that takes K-FAC's preconditioned gradients: momentum (SGD with the
    workload's momentum) | sgd | adam."""
    method: KFACMethod = "eigen"
    """eigen (the factors' eigendecompositions, damping on the products of their eigenvalues)
    | inverse (Cholesky inverses of the factors each damped by sqrt(damping): about a tenth of
    the inverse step's time on a GPU, with damping that grows with the factors)."""
    damping: float = 0.001
    """Tikhonov damping added to every product of the two factors' eigenvalues: larger is
    closer to SGD and steadier."""
    factor_decay: float = 0.95
    """Weight of the old factors in their running average at each factor update, from 0 (the
    latest batch alone) to below 1."""
    kl_clip: float | None = 0.001
    """KL clipping: all preconditioned gradients are scaled by min(1, sqrt(kl_clip / (lr^2 *
    sum of preconditioned x raw gradient))). None (Python only): no clipping."""
    factor_update_freq: int = 1
    """Steps between factor updates; the layers' inputs and output gradients are read on those
    steps only."""
    inv_update_freq: int = 10
    """Steps between inverse steps: the factors' eigendecompositions or inverses (each waits
    for the device)."""
    factor_precision: str = "tf32"
    """How the factors' products are made on a GPU (the factors themselves are fp32): fp32 |
    tf32 (TF32 tensor cores) | bf16 (inputs rounded to bf16, fp32 sums). A CPU makes them in
    fp32."""
    factor_comm_dtype: KFACCommDtype = "fp32"
    """With data-parallel workers, the dtype the batch factors are averaged in over them:
    fp32 | bf16 | fp16 (half the bytes; the average is kept in fp32)."""

    def check(self) -> None:
        """Refuse values no run can use (``ConfigError`` naming the flag)."""
        for name, value, choices in ((flag("kfac.base"), self.base, KFAC_BASES),
                                     (flag("kfac.method"), self.method, KFAC_METHODS),
                                     (flag("kfac.factor_precision"), self.factor_precision,
                                      FACTOR_PRECISIONS),
                                     (flag("kfac.factor_comm_dtype"), self.factor_comm_dtype,
                                      KFAC_COMM_DTYPES)):
            if value not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if not _finite(self.damping) or self.damping <= 0:
            raise ConfigError(f"{flag('kfac.damping')} must be a positive, finite number, got "
                              f"{self.damping!r}")
        if not _finite(self.factor_decay) or not 0 <= self.factor_decay < 1:
            raise ConfigError(f"{flag('kfac.factor_decay')} must be from 0 to below 1 (1 would "
                              f"never update the factors), got {self.factor_decay!r}")
        if self.kl_clip is not None and (not _finite(self.kl_clip) or self.kl_clip <= 0):
            raise ConfigError(f"{flag('kfac.kl_clip')} must be a positive, finite number (or None "
                              f"in Python: no clipping), got {self.kl_clip!r}")
        for name, value in ((flag("kfac.factor_update_freq"), self.factor_update_freq),
                            (flag("kfac.inv_update_freq"), self.inv_update_freq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
