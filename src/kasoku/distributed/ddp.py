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
import time

import torch
import torch.distributed as dist
from torch import nn

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.distributed.config import DistConfig
from kasoku.distributed.world import World, restart_count


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(world: World, device_type: str) -> torch.device:
    """This worker's device: GPU ``LOCAL_RANK`` on CUDA (set as the current device), else the
    CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{flag('dist.gpus')} needs CUDA, which this machine lacks; use "
                          f"{flag('dist.procs')} N for N CPU processes (gloo)")
    if world.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"worker {world.rank} wants GPU {world.local_rank}, but this machine has "
                          f"{torch.cuda.device_count()}; ask for fewer with {flag('dist.gpus')}")
    device = torch.device("cuda", world.local_rank)
    torch.cuda.set_device(device)
    return device


def join(world: World, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group (``init_process_group`` from the launcher's environment),
    with ``timeout_s`` as every collective's time limit; through the job's store, the workers
    first agree on which attempt of the job theirs is (``attempt``)."""
    global _attempt
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the communicator to this worker's GPU at once
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        kwargs["store"], _attempt = _attempt_store(world, timeout_s)
    dist.init_process_group(backend_for(device), rank=world.rank, world_size=world.world_size,
                            timeout=timeout, **kwargs)


_attempt = None  # this worker group's attempt, agreed in join


def attempt() -> int:
    """Which attempt of the job this worker's group is, the same on all its workers: 0 the
    first, more once the job was restarted on any machine (a restarted group resumes from the
    run's latest snapshot). Before ``join``, or without a job store, the launcher's restart
    count."""
    return restart_count() if _attempt is None else _attempt


ATTEMPTS = "kasoku/attempts"
"""The store's keys of the attempts: ``latest``, and a folder per attempt number."""

POLL_S = 0.05


def _attempt_store(world: World, timeout_s: float) -> tuple:
    """``(store, attempt)``: the job's TCP store (the launcher's, or worker 0's), its keys
    prefixed with the attempt the workers agreed on, and that attempt (see ``attempt``). A
    restarted worker group would otherwise read the addresses a failed attempt's workers left
    there and fail to connect (seen with gloo, torch 2.13).

    Agreed through the store, not from the launcher's restart count: under torchrun's c10d
    rendezvous, a machine whose workers were still running when another one's failed
    restarts them without counting a restart, so the count differs between machines."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world.world_size, is_master=not agent and world.rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s),
                          multi_tenant=not agent)
    number, restarts = _agree_on_attempt(store, world.rank, world.world_size, timeout_s)
    # A store that lives as long as the job counts every restart; one a worker hosts starts
    # at 0 again with each attempt, and then only the launchers' counts tell.
    return dist.PrefixStore(f"kasoku/attempt_{number}", store), max(number, restarts)


def _agree_on_attempt(store, rank: int, world_size: int, timeout_s: float) -> tuple[int, int]:
    """``(number, restarts)``: the attempt number this worker shares with the other workers of
    its group, never one an earlier group used in ``store``; the largest launcher restart
    count among them.

    Each number N has a seat per rank (an atomic counter): a worker takes its rank's seat in
    the latest number, or, where a worker of its rank sat there before (its group failed),
    moves the latest number on and sits there. A number is the group's once every rank's seat
    is taken and then every seated worker confirmed it: a worker that died before its group
    was complete never confirms, and its rank's next worker moves the others on with it."""
    latest = f"{ATTEMPTS}/latest"
    deadline = time.monotonic() + timeout_s
    number = int(store.add(latest, 0))
    while True:
        here = f"{ATTEMPTS}/{number}"
        if store.add(f"{here}/rank{rank}", 1) == 1:
            store.set(f"{here}/restarts{rank}", str(restart_count()))
            # Counters per world size: a rank new to a larger world finds its seat free.
            if _all_add(store, f"{here}/of{world_size}/seated", world_size, latest, number,
                        deadline) and \
                    _all_add(store, f"{here}/of{world_size}/confirmed", world_size, latest,
                             number, deadline):
                return number, max(int(store.get(f"{here}/restarts{r}"))
                                   for r in range(world_size))
        number = _raise_to(store, latest, number + 1)


def _all_add(store, counter: str, world_size: int, latest: str, number: int,
             deadline: float) -> bool:
    """Add 1 to ``counter`` and wait until ``world_size`` workers did: True; False as soon as
    the ``latest`` attempt is past ``number`` (its group will not form)."""
    if store.add(counter, 1) == world_size:
        store.set(f"{counter}/all", "1")
    while not store.check([f"{counter}/all"]):
        if int(store.get(latest)) > number:
            return False
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"the workers of attempt {number} timed out: {int(store.add(counter, 0))} of "
                f"{world_size} came ({counter})")
        time.sleep(POLL_S)
    return True


def _raise_to(store, key: str, number: int) -> int:
    """Set the counter ``key`` to ``number`` unless it is past it already; its new value."""
    current = int(store.get(key))
    while current < number:
        current = int(store.compare_set(key, str(current), str(number)))
    return current


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
                f"({flag('dist.dist_timeout')}): another worker stopped, hangs or is far slower "
                f"[{type(exc).__name__}: {text[:300]}]")
    return f"worker {rank}: {type(exc).__name__}: {text[:500]}"


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
