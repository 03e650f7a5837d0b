"""Sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``): every worker
holds 1/N of each parameter, gradient and optimizer state, all-gathers a block's parameters
just before the block runs (forward and backward) and reduce-scatters its gradients after.

``shard`` wraps as torchtitan does (with ``--compile``, each block compiled first:
``sharder``): each transformer block a unit of its own, then the root
(the embeddings, the final norm and the head, and any model without ``blocks``), so one
block's parameters are whole at a time; the next block's all-gather is issued ahead
(explicit forward and backward prefetching). With ``--precision bf16`` on CUDA the parameters
are gathered and computed in bf16 and the gradients reduced in fp32 (``MixedPrecisionPolicy``,
``policy``); in fp32 or tf32, and on a CPU, they stay fp32.

Snapshots of a sharded model go through ``torch.distributed.checkpoint`` (DCP): each worker
writes its own shards into one folder (``save_sharded``), which ``load_sharded`` reads into
any number of workers, sharded or not (DCP reshards on load).
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from kasoku.core.errors import warn_once
from kasoku.core.flags import flag

# FSDP2 and torch.distributed.checkpoint are imported inside the functions that use them:
# together they take 1.5 s to import on a 2-core machine, which every run would pay, and only
# a sharded run (or the resume of its snapshot) needs them.

MODEL_KEYS = ("model", "optimizer")
"""The entries of a trainer's state that DCP writes; the rest is a plain file beside them."""


def policy_dtypes(precision: str, device: torch.device) -> tuple:
    """``(param_dtype, reduce_dtype)`` of FSDP2's ``MixedPrecisionPolicy`` for ``precision``
    (``AccelConfig.precision``) on ``device``: ``(bf16, fp32)`` for bf16 on CUDA, the
    parameters gathered in bf16 (half the all-gather's bytes) and the gradients summed in
    fp32; ``(None, None)``, no cast, otherwise."""
    if precision == "bf16" and device.type == "cuda":
        return torch.bfloat16, torch.float32
    return None, None


def shard(model: nn.Module, device: torch.device, precision: str = "fp32") -> nn.Module:
    """``model`` (on ``device``, in the process group of the job) sharded over the workers,
    in place: each module of ``model.blocks`` (a ``ModuleList``) then the root, its
    parameters in the dtype ``policy_dtypes`` gives ``precision``. Must run before the
    optimizer is built: ``fully_shard`` replaces the parameters by DTensor shards, and an
    optimizer built earlier would hold the old, whole ones."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # deferred: 1.5 s
    param_dtype, reduce_dtype = policy_dtypes(precision, device)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if precision == "bf16" and device.type != "cuda":
        warn_once(f"{flag('dist.shard')} on a CPU keeps the parameters fp32 (bf16 parameters with "
                  "an fp32 reduction are the CUDA policy; on a CPU bf16 matrix products are no "
                  "faster and lose precision)")
    blocks = list(getattr(model, "blocks", None) or ())
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=policy,
                    reshard_after_forward=not kept_whole(i, len(blocks) + 1))
    fully_shard(model, mp_policy=policy)  # FSDP2 keeps the root whole after its forward
    for first, then in zip(blocks, blocks[1:]):
        first.set_modules_to_forward_prefetch([then])  # the next block's all-gather ahead
        then.set_modules_to_backward_prefetch([first])
    return model


@dataclass(frozen=True)
class Distribute:
    """The ``distribute`` step ``kasoku.accel.compose.accelerate`` takes: ``wrap(model) ->
    model`` for data-parallel training (DDP's wrap, FSDP2's ``shard``), called as
    ``distribute(model)``. ``compiles_blocks``: ``--compile`` compiles each block of the model
    before the wrap, inside its own unit (as torchtitan does with FSDP2: its hooks stay outside
    the compiled code), instead of the whole model after it."""
    wrap: Callable[[nn.Module], nn.Module]
    compiles_blocks: bool = False

    def __call__(self, model: nn.Module) -> nn.Module:
        return self.wrap(model)


def sharder(device: torch.device, precision: str = "fp32") -> Distribute:
    """``shard`` as a ``Distribute`` step, its blocks compiled before the wrap."""
    return Distribute(lambda model: shard(model, device, precision), compiles_blocks=True)


def data_parallel(dist_cfg, device: torch.device, precision: str = "fp32") -> Distribute:
    """The ``distribute`` step of ``dist_cfg`` (a ``DistConfig``): FSDP2's ``sharder`` with
    ``shard`` (its parameters' dtype from ``precision``, ``AccelConfig.precision``), else DDP's
    wrap (``kasoku.distributed.ddp.wrap``) in its settings."""
    if dist_cfg.shard:
        return sharder(device, precision)
    from kasoku.distributed import ddp  # beside this module: its process group, its wrap
    return Distribute(lambda model: ddp.wrap(model, dist_cfg, device))


def kept_whole(index: int, count: int) -> bool:
    """Whether unit ``index`` of ``count`` in ``shard``'s order stays whole after its forward
    (gathered once a step, not again for the backward): the last block, whose parameters the
    backward pass needs first (torchtitan does the same), and the root (FSDP2's own rule)."""
    return index >= count - 2


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of ``model`` in ``shard``'s order: the blocks, then the root."""
    found = [m for m in model.modules() if is_sharded(m)]
    return found[1:] + found[:1]  # modules() lists the root first


def unit_sizes(model: nn.Module) -> list[int]:
    """The whole (unsharded) element count of each FSDP unit's own parameters, those of no
    unit inside it: what one all-gather of that unit brings and one reduce-scatter of its
    gradients sends, in ``shard``'s order (``units``)."""
    sizes = []
    for unit in units(model):
        inner = {id(p) for sub in unit.modules() if sub is not unit and is_sharded(sub)
                 for p in sub.parameters()}
        sizes.append(sum(p.numel() for p in unit.parameters() if id(p) not in inner))
    return sizes


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by ``fully_shard`` (FSDP2)."""
    fsdp2 = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing is sharded
    return fsdp2 is not None and isinstance(model, fsdp2.FSDPModule)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Within: every FSDP unit of ``model`` whole on every worker, kept whole across
    forwards, so that the workers may run different numbers of forwards (an evaluation pass
    over shards of unequal size: a forward that all-gathers would wait for the others'). The
    all-gathers happen on entry and the shards come back on exit, on every worker alike. A
    no-op for a model that is not sharded."""
    if not is_sharded(model):
        yield
        return
    ordered = units(model)
    for unit in ordered:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in ordered:
            unit.unshard()
        yield
    finally:
        for i, unit in enumerate(ordered):
            unit.reshard()
            unit.set_reshard_after_forward(not kept_whole(i, len(ordered)), recurse=False)


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model": ..., "optimizer": ...}`` keyed by parameter names (not optimizer indices),
    sharded tensors as DTensors: what ``save_sharded`` writes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # deferred: 1.5 s
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(sharded: dict, folder: Path) -> None:
    """Every worker writes its shards of ``sharded`` (``state``) into ``folder`` (one file
    each, and worker 0 the metadata). A collective: every worker calls it, and it returns on
    worker 0 once every worker's file is written."""
    import torch.distributed.checkpoint as dcp  # deferred: 1.5 s, see the imports
    dcp.save(sharded, checkpoint_id=str(folder), no_dist=not _in_job())


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load ``folder`` (``save_sharded``'s) into ``model`` and ``optimizer``, sharded or not,
    of any number of workers: DCP reads the pieces of this run's shards (the whole tensors
    when the model is not sharded). A collective in a job; alone, no process group is
    needed."""
    import torch.distributed.checkpoint as dcp  # deferred: 1.5 s, see the imports
    from torch.distributed.checkpoint.state_dict import set_state_dict  # deferred: 1.5 s

    model = getattr(model, "module", model)  # DDP's wrapper: the names are the module's
    target = state(model, optimizer)  # optimizer state made where there was none (step 0)
    with warnings.catch_warnings():
        # Alone, DCP says it assumes a single process, which is what is meant.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(folder), no_dist=not _in_job())
    set_state_dict(model, optimizer, model_state_dict=target["model"],
                   optim_state_dict=target["optimizer"])


def _in_job() -> bool:
    """Whether this process is in a process group (else DCP reads and writes alone)."""
    return dist.is_available() and dist.is_initialized()
