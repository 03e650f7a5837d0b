"""K-FAC over data-parallel workers (KAISA, Pauloski et al. 2020-21): the batch factors averaged
over the workers, the eigendecompositions spread over them, and the eigenbases sent to all.

- ``average_factors``: before they enter the running averages, each layer's ``A`` and ``G``
  of this step are averaged over the workers, flattened into a few buffers (one all-reduce
  each, ``BUCKET_NUMEL`` elements at most), optionally sent in bf16 or fp16; the average is
  kept in float32. With the same per-worker batch, the mean of the workers' means is the
  factor of the whole batch (``G`` is multiplied back by the per-worker batch, see
  ``kasoku.kfac.factors``), so the running factors are those of one process on the
  concatenated batch.
- ``assign``: each factor (``A`` or ``G`` of a layer) is an eigendecomposition of cost
  ``dim^3``; the largest go first to the least loaded worker. Computed from the layers'
  shapes alone, so every worker makes the same assignment without a word exchanged.
- ``share_eigenbases``: every worker eigendecomposes its own factors, then each worker's
  eigenvectors and eigenvalues go to all in one broadcast from it (one per worker). The
  factors are the same everywhere, so after it every worker holds the same eigenbases, and
  with DDP's averaged gradients every worker applies the same preconditioned update.

A worker's ``eigh`` that fails (in float32 and float64) marks its buffer, so every worker
raises the same error instead of the others waiting for a broadcast that never comes.

kasoku's own code: kfac-pytorch (KAISA, MIT), the reference for the design and the numerics,
is not published on PyPI, and ASDL's package is an alpha tested on PyTorch 1.13 only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kasoku.core.flags import flag
from kasoku.kfac import eigen

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``KFACConfig.factor_comm_dtype``: the dtype the batch factors are all-reduced in."""

BUCKET_NUMEL = 1 << 23
"""Elements per all-reduce of the factors (32 MiB in float32): one buffer for small models,
a few for ResNet-50's, without a second copy of all the factors at once."""


def world_size() -> int:
    return dist.get_world_size()


def assign(dims: list[tuple[int, int]], num_workers: int) -> list[tuple[int, int]]:
    """The worker that eigendecomposes each factor: for layer ``i`` with factor sizes
    ``dims[i] = (dim_A, dim_G)``, ``(owner of A, owner of G)``. Greedy on ``dim^3``: factors
    in decreasing cost (ties in layer order, ``A`` before ``G``) each to the worker with the
    least work so far (ties to the lowest rank). Deterministic: the same on every worker."""
    work = [0] * num_workers
    owners = [[0, 0] for _ in dims]
    jobs = sorted(((d ** 3, i, k) for i, pair in enumerate(dims) for k, d in enumerate(pair)),
                  key=lambda job: (-job[0], job[1], job[2]))
    for cost, i, k in jobs:
        rank = min(range(num_workers), key=lambda r: (work[r], r))
        owners[i][k] = rank
        work[rank] += cost
    return [tuple(pair) for pair in owners]


def average_factors(tensors: list[torch.Tensor], comm_dtype: str = "fp32") -> list[torch.Tensor]:
    """The element-wise means of ``tensors`` (float32, same shapes and order on every worker)
    over the workers, as new float32 tensors; sent as ``comm_dtype`` (each worker's share is
    divided by the number of workers before the cast, so fp16's range holds the sum)."""
    out: list[torch.Tensor] = []
    dtype, share = COMM_DTYPES[comm_dtype], 1.0 / world_size()
    start = 0
    while start < len(tensors):
        end, numel = start, 0
        while end < len(tensors) and (end == start or numel + tensors[end].numel()
                                      <= BUCKET_NUMEL):
            numel += tensors[end].numel()
            end += 1
        bucket = tensors[start:end]
        flat = torch.cat([t.reshape(-1) for t in bucket]).mul_(share).to(dtype)
        dist.all_reduce(flat)
        flat = flat.float()
        offset = 0
        for t in bucket:
            out.append(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        start = end
    return out


def share_eigenbases(layers: list, owners: list[tuple[int, int]], method: str = "eigen",
                     damping: float = 0.0) -> None:
    """Eigendecompose (or invert, by ``method``: ``eigen.invert``) the factors of
    ``layers`` (``KFACLayer``s, every one with both running factors, in the same order on
    every worker) that ``owners`` gives this worker, and receive the others' from their
    owners: afterwards every layer's ``QA``, ``LA``, ``QG``, ``LG`` are the same on every
    worker. One broadcast per worker; the sizes are known from the factors, so nothing else is
    exchanged. Raises ``eigen.EighError`` on every worker when any factor could not be
    decomposed."""
    eig = method == "eigen"  # the inverse method sends the inverse alone: no eigenvalues
    rank, workers = dist.get_rank(), world_size()
    device = layers[0].state["A"].device
    failed = -1.0
    for i, layer in enumerate(layers):
        for k, key in enumerate("AG"):
            if owners[i][k] != rank:
                continue
            try:
                values, vectors = eigen.invert(layer.state[key], method, damping)
            except eigen.EighError:
                values = vectors = None
                failed = float(i) if failed < 0 else failed
            layer.state["L" + key], layer.state["Q" + key] = values, vectors
    for src in range(workers):
        parts = [(i, key) for i, layer in enumerate(layers) for key in "AG"
                 if owners[i]["AG".index(key)] == src]
        sizes = [layers[i].state[key].shape[0] for i, key in parts]
        numel = sum(d * d + d * eig for d in sizes) + 1  # + a flag: a layer's index or -1
        if src == rank:
            pieces = []
            for i, key in parts:
                s = layers[i].state
                if s["Q" + key] is None:  # a failed eigh: zeros, the flag says which
                    d = s[key].shape[0]
                    pieces += [s[key].new_zeros(d * d + d * eig)]
                else:
                    pieces += [s["Q" + key].reshape(-1)] + [s["L" + key]] * eig
            pieces.append(torch.tensor([failed], device=device))
            flat = torch.cat(pieces)
        else:
            flat = torch.empty(numel, device=device)
        dist.broadcast(flat, src=src)
        # A host read of the flag: the inverse steps already wait for eigh on the device.
        bad = int(flat[-1].item())
        if bad >= 0:
            raise eigen.EighError(
                f"K-FAC: the factors of layer {layers[bad].name!r} cannot be decomposed, "
                f"in float32 nor in float64 (on worker {src}); they hold inf or nan: training "
                f"diverged. Lower {flag('train.lr')} or raise {flag('kfac.damping')}")
        if src == rank:
            continue
        offset = 0
        for (i, key), d in zip(parts, sizes):
            s = layers[i].state
            # Copies, not views of the buffer: a snapshot saves each tensor's whole storage.
            s["Q" + key] = flat[offset:offset + d * d].view(d, d).clone()
            s["L" + key] = flat[offset + d * d:offset + d * d + d].clone() if eig else None
            offset += d * d + d * eig
