"""K-FAC's two ways to precondition -- the eigen-decomposition method (the default) and the
inverse method -- and the KL-clipping scale.

With ``A = Q_A diag(l_A) Q_A^T`` and ``G = Q_G diag(l_G) Q_G^T``, the damped Fisher block is
``G (x) A + damping I = (Q_G (x) Q_A) diag(l_G (x) l_A + damping) (Q_G (x) Q_A)^T``, so its
solve against the gradient matrix ``g`` (``[out, in (+1)]``) is two small products each way::

    V = Q_G [(Q_G^T g Q_A) / (l_G l_A^T + damping)] Q_A^T

(kfac-pytorch's eigen layers; the damping sits on the eigenvalue products, not on each
factor). Eigenvalues are clamped at 0: rounding can make those of a semi-definite factor
slightly negative.

The inverse method (kfac-pytorch's ``ComputeMethod.INVERSE``) damps each factor by
``sqrt(damping)`` and inverts it through a Cholesky factorization, ``V = (G + sI)^-1 g (A +
sI)^-1`` with ``s = sqrt(damping)``: it solves against ``(G + sI) (x) (A + sI) = G (x) A +
s (G (x) I + I (x) A) + damping I``, a damping that also grows with the factors, and its
inverse step costs about a tenth of the eigendecompositions on a GPU (an H200: 65 ms against
685 ms for ResNet-18's factors, ``research/probes/kfac_inverse_cost.py``).

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import torch

from kasoku.core.errors import NonFiniteError, warn_once
from kasoku.core.flags import flag


class EighError(NonFiniteError):
    """``eigh`` (or the inverse method's Cholesky factorization) failed in float32 and again
    in float64: the factor is not a finite symmetric matrix (training diverged; the command
    line says so in one line, as for a loss of nan)."""


def eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues >= 0, eigenvectors)`` of the symmetric float32 ``factor``, in float32.
    When float32's ``eigh`` fails (it does not converge on some ill-conditioned factors), it
    is retried in float64 and the result cast back, with a warning once per process. Note:
    on CUDA, ``eigh`` checks for failure on the host (a sync point)."""
    try:
        values, vectors = torch.linalg.eigh(factor)
    except torch.linalg.LinAlgError:
        warn_once("K-FAC: eigh of a factor failed in float32; retried in float64 (a factor "
                  f"this ill-conditioned may want a larger {flag('kfac.damping')})")
        try:
            values, vectors = torch.linalg.eigh(factor.double())
        except torch.linalg.LinAlgError as exc:
            raise EighError(f"{exc}".strip().splitlines()[0]) from None
        values, vectors = values.to(factor.dtype), vectors.to(factor.dtype)
    return values.clamp(min=0.0), vectors


def damped_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """``(factor + sqrt(damping) I)^-1`` of the symmetric float32 ``factor`` (the inverse
    method), through a Cholesky factorization; retried in float64 when float32's fails, as
    ``eigh``. Note: on CUDA, the factorization checks for failure on the host (a sync)."""
    damped = factor + torch.eye(factor.shape[0], dtype=factor.dtype,
                                device=factor.device) * damping ** 0.5
    lower, info = torch.linalg.cholesky_ex(damped)
    if int(info) == 0:
        return torch.cholesky_inverse(lower)
    warn_once("K-FAC: the Cholesky factorization of a damped factor failed in float32; "
              "retried in float64 (a factor this ill-conditioned may want a larger "
              f"{flag('kfac.damping')})")
    lower, info = torch.linalg.cholesky_ex(damped.double())
    if int(info) != 0:
        raise EighError(f"the damped factor is not positive definite (minor {int(info)})")
    return torch.cholesky_inverse(lower).to(factor.dtype)


def invert(factor: torch.Tensor, method: str, damping: float):
    """``(L, Q)`` of a factor: its eigenvalues and eigenvectors (``eigen``), or None and its
    damped inverse (``inverse``); ``EighError`` when neither float32 nor float64 can."""
    if method == "inverse":
        return None, damped_inverse(factor, damping)
    return eigh(factor)


def precondition(grad: torch.Tensor, qa: torch.Tensor, la: torch.Tensor, qg: torch.Tensor,
                 lg: torch.Tensor, damping: float) -> torch.Tensor:
    """``V`` of the module doc for the gradient matrix ``grad`` (``[out, in (+1)]``, float32)."""
    v = qg.t() @ grad @ qa
    v = v / (torch.outer(lg, la) + damping)
    return qg @ v @ qa.t()


def kl_scale(vg: torch.Tensor, kl_clip: float) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |vg|))`` as a 0-dim tensor, where ``vg`` is ``sum lr^2 v . g``
    over the preconditioned layers: the step's predicted change of the KL divergence stays
    under ``kl_clip``. Computed on the device (no host sync); ``vg == 0`` gives 1."""
    return (kl_clip / vg.abs()).sqrt().clamp(max=1.0)
