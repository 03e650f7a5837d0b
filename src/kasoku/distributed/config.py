"""The settings of a data-parallel run: how many workers, where they meet, and how DDP
exchanges their gradients. Field docstrings are the command line's help texts."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

AllreduceDtype = Literal["fp32", "bf16", "fp16"]
ALLREDUCE_DTYPES: tuple[str, ...] = get_args(AllreduceDtype)
NumaBinding = Literal["node", "socket", "exclusive", "core-complex"]
NUMA_BINDINGS: tuple[str, ...] = get_args(NumaBinding)


@dataclass
class DistConfig:
    gpus: int | None = None
    """Train on N GPUs of this machine, one worker process each (NCCL); kasoku starts them
    through PyTorch's elastic launcher. --batch-size is per GPU."""
    procs: int | None = None
    """Train in N CPU processes (gloo), as --gpus does on GPUs. --batch-size is per process."""
    nnodes: int = 1
    """Machines in the job; each runs the same command with its own --node-rank."""
    node_rank: int = 0
    """This machine's number among --nnodes, from 0 (machine 0 hosts the rendezvous)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of machine 0, where the workers of all machines meet (needed with --nnodes >
    1; default on one machine: a free local port)."""
    max_restarts: int = 0
    """Times the launcher restarts the workers after one fails; each restart resumes from the
    run's latest snapshot."""
    dist_timeout: float = 300.0
    """Seconds a collective may wait for the other workers before the job stops with an error
    naming the rank (a worker that died or hangs)."""
    bucket_mb: float = 25.0
    """DDP's gradient bucket size in MB (each bucket is one all-reduce, started as soon as its
    gradients are ready in the backward pass)."""
    static_graph: bool = False
    """Tell DDP the set of parameters used does not change between steps (lets it skip
    per-step bookkeeping and overlap better)."""
    allreduce_dtype: AllreduceDtype = "fp32"
    """The gradients' dtype on the wire: fp32, or bf16/fp16 (half the bytes; DDP's
    compression hooks, the sum taken in that dtype)."""
    sync_bn: bool = False
    """Batch norm statistics over the whole global batch (SyncBatchNorm), not each worker's
    shard."""
    shard: bool = False
    """Shard the parameters, gradients and optimizer state over the workers (FSDP2,
    fully_shard per transformer block, then the whole model) instead of replicating them
    (DDP); snapshots become folders written by every worker (torch.distributed.checkpoint)
    that resume on any number of workers."""
    numa_binding: NumaBinding | None = None
    """Bind each GPU worker and its threads to CPUs near its GPU (PyTorch's launcher, through
    numactl): node (its GPU's NUMA node), socket, exclusive (the node's physical cores split
    between the node's GPUs: none shared), core-complex (one shared last-level cache); with
    --gpus."""
    scale_lr: bool = False
    """Linear scaling rule: multiply the learning rate by the number of workers (the global
    batch over the recipe's) with a gradual warmup (Goyal et al. 2017)."""

    @property
    def workers(self) -> int:
        """Worker processes per machine this config asks for (1 when it asks for none)."""
        return self.gpus or self.procs or 1

    @property
    def asked(self) -> bool:
        """Whether the command asked for a data-parallel run (--gpus, --procs, --nnodes)."""
        return self.gpus is not None or self.procs is not None or self.nnodes > 1

    def check(self) -> None:
        if self.gpus is not None and self.procs is not None:
            raise ConfigError(f"{flag('dist.gpus')} and {flag('dist.procs')} exclude each other: "
                              f"{flag('dist.gpus')} N for N GPUs (NCCL), {flag('dist.procs')} N "
                              "for N CPU processes (gloo)")
        for name, value, least in ((flag("dist.gpus"), self.gpus, 1),
                                   (flag("dist.procs"), self.procs, 1),
                                   (flag("dist.nnodes"), self.nnodes, 1),
                                   (flag("dist.node_rank"), self.node_rank, 0),
                                   (flag("dist.max_restarts"), self.max_restarts, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ConfigError(f"{name} must be a whole number >= {least}, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"{flag('dist.node_rank')} {self.node_rank} is not one of the "
                              f"{self.nnodes} machines of {flag('dist.nnodes')} (0 to "
                              f"{self.nnodes - 1})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"{flag('dist.nnodes')} > 1 needs {flag('dist.rdzv_endpoint')} "
                              "HOST:PORT, machine 0's address and a free port, the same on every "
                              "machine")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{flag('dist.rdzv_endpoint')} must be HOST:PORT, got "
                                  f"{self.rdzv_endpoint!r}")
        for name, value in ((flag("dist.dist_timeout"), self.dist_timeout),
                            (flag("dist.bucket_mb"), self.bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.numa_binding is not None and (self.numa_binding not in NUMA_BINDINGS
                                              or self.procs is not None):
            raise ConfigError(f"{flag('dist.numa_binding')} takes one of "
                              f"{', '.join(NUMA_BINDINGS)} and binds the workers of "
                              f"{flag('dist.gpus')} N to CPUs near their GPUs"
                              + ("" if self.numa_binding in NUMA_BINDINGS else
                                 f"; got {self.numa_binding!r}"))
        if self.allreduce_dtype not in ALLREDUCE_DTYPES:
            raise ConfigError(f"{flag('dist.allreduce_dtype')} must be one of "
                              f"{', '.join(ALLREDUCE_DTYPES)}, got {self.allreduce_dtype!r}")
        ddp_only = [name for name, on in ((flag("dist.allreduce_dtype"),
                                           self.allreduce_dtype != "fp32"),
                                          (flag("dist.static_graph"), self.static_graph),
                                          (flag("dist.sync_bn"), self.sync_bn)) if on]
        if self.shard and ddp_only:
            raise ConfigError(f"{ddp_only[0]} is a setting of DDP, which {flag('dist.shard')} "
                              "replaces (FSDP2 reduces in fp32 and keeps batch norm per worker); "
                              "drop one of them")
