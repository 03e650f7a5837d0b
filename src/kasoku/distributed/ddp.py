"""Data-parallel training inside one worker: joining the process group, wrapping the model in
PyTorch's ``DistributedDataParallel``, and the few collectives the trainer needs outside the
step (evaluation sums, RNG states for snapshots).

Each worker holds a whole model and a shard of every batch; DDP all-reduces the gradients in
buckets during the backward pass, so every worker applies the same update. kasoku adds
nothing to the exchange itself: the bucket size, static graph and gradient dtype are DDP's
own options and communication hooks.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from kasoku.core.errors import ConfigError
from kasoku.distributed.config import DistConfig
from kasoku.distributed.world import World


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(world: World, device_type: str) -> torch.device:
    """This worker's device: GPU ``LOCAL_RANK`` on CUDA (set as the current device), else the
    CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--gpus needs CUDA, which this machine lacks; use --procs N for N "
                          "CPU processes (gloo)")
    if world.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"worker {world.rank} wants GPU {world.local_rank}, but this machine "
                          f"has {torch.cuda.device_count()}; ask for fewer with --gpus")
    device = torch.device("cuda", world.local_rank)
    torch.cuda.set_device(device)
    return device


def join(world: World, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group (``init_process_group`` from the launcher's environment),
    with ``timeout_s`` as every collective's time limit."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the communicator to this worker's GPU at once
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        kwargs["store"] = _attempt_store(world, timeout)
    dist.init_process_group(backend_for(device), rank=world.rank, world_size=world.world_size,
                            timeout=timeout, **kwargs)


def _attempt_store(world: World, timeout: datetime.timedelta):
    """The job's TCP store (the launcher's, or worker 0's), its keys prefixed with the
    launcher's restart count: a restarted worker group would otherwise read the addresses the
    failed attempt's workers left there and fail to connect (seen with gloo, torch 2.13)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world.world_size, is_master=not agent and world.rank == 0,
                          timeout=timeout, multi_tenant=not agent)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"kasoku/attempt_{attempt}", store)


def leave() -> None:
    global _control
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()


_control = None  # the job's gloo group for flags (control_group)


def control_group():
    """A gloo group of all workers, for small host-side agreements beside the job's own
    backend (NCCL's collectives would need a device tensor and a synchronize). Made once, by
    every worker (``new_group`` is itself collective); the default group when it is gloo."""
    global _control
    if _control is None:
        _control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" \
            else dist.group.WORLD
    return _control


class AgreedFlag:
    """A flag every worker polls once per step, answered alike on all at the same step: the
    largest value any worker gave at the poll before (0 when none). The all-reduce of each
    poll runs in the background (gloo, ``control_group``) and is read at the next poll, so a
    poll never waits for the others. Every worker must poll equally often; ``close`` waits for
    the last all-reduce (before the group goes)."""

    def __init__(self):
        self._group = control_group()
        self._box = torch.zeros(1, dtype=torch.int64)
        self._pending = None

    def poll(self, value: int) -> int:
        agreed = 0
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            agreed = int(self._box.item())
        if agreed:
            return agreed
        self._box.fill_(int(value))
        self._pending = dist.all_reduce(self._box, op=dist.ReduceOp.MAX, group=self._group,
                                        async_op=True)
        return 0

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def active() -> bool:
    """Whether this process is one worker of several (a process group of more than one)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def wrap(model: nn.Module, cfg: DistConfig, device: torch.device) -> nn.Module:
    """``model`` (on ``device``, its levers applied, not yet compiled) as DDP sees fit for
    kasoku: gradients as views of the buckets (no copy between them), the bucket size, static
    graph, SyncBatchNorm and the gradient dtype of ``cfg``."""
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
        static_graph=cfg.static_graph)
    if cfg.allreduce_dtype != "fp32":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = {"bf16": default_hooks.bf16_compress_hook,
                "fp16": default_hooks.fp16_compress_hook}[cfg.allreduce_dtype]
        ddp.register_comm_hook(None, hook)
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP (``model`` itself when it is not wrapped)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def sum_over_workers(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """The element-wise sums of ``values`` over all workers (one all-reduce); ``values``
    themselves when this process is alone."""
    if not active():
        return values
    device = values[0].device  # NCCL sums device tensors only
    flat = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
    dist.all_reduce(flat)
    return [flat[i] for i in range(len(values))]


def gather_objects(obj) -> list:
    """``obj`` of every worker, in rank order (``[obj]`` when alone)."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Worker ``src``'s ``obj`` on every worker."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def describe_failure(exc: BaseException, rank: int, timeout_s: float) -> str:
    """One line for an exception raised in worker ``rank``: a collective that timed out says
    so, naming the likely causes."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered or \
            type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return (f"worker {rank}: a collective did not complete within {timeout_s:g} s "
                f"(--dist-timeout): another worker stopped, hangs or is far slower "
                f"[{type(exc).__name__}: {text[:300]}]")
    return f"worker {rank}: {type(exc).__name__}: {text[:500]}"


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
