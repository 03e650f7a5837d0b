"""K-FAC (Martens & Grosse 2015; Osawa et al. 2019; KAISA, Pauloski et al. 2020-21): a
Kronecker-factored approximation of the Fisher matrix that preconditions the gradients of
Linear and Conv2d layers in front of a base optimizer (``--optimizer kfac``).

- ``config``: ``KFACConfig`` (damping, factor decay, KL clip, update intervals, base optimizer)
- ``factors``: one batch's ``A`` and ``G`` factors of a Linear or Conv2d layer
- ``eigen``: eigenbases (float64 retry), the preconditioned gradient, the KL-clip scale
- ``preconditioner``: the hooks, the running factors and the in-place preconditioning
- ``phases``: K-FAC's phases on the phase clock (``kfac_factors``, ``kfac_inverse``,
  ``kfac_precondition``), declared to it
- ``optimizer``: ``KFAC``, the preconditioner and a base optimizer as one torch optimizer;
  ``check_levers``
- ``distributed``: with data-parallel workers, the factors averaged over them and the
  eigendecompositions shared out (KAISA)

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.

The names below are imported on first use (PEP 562): ``config`` loads without torch, for the
command line's ``--kfac-*`` flags.
"""
from __future__ import annotations

from kasoku.core.lazy_exports import lazy_exports

__all__ = ["KFAC", "KFACConfig", "KFACPreconditioner", "KFAC_BASES", "check_levers"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "KFAC": "kasoku.kfac.optimizer", "KFACConfig": "kasoku.kfac.config",
    "KFACPreconditioner": "kasoku.kfac.preconditioner", "KFAC_BASES": "kasoku.kfac.config",
    "check_levers": "kasoku.kfac.optimizer"})
