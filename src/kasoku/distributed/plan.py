"""What a data-parallel measurement launches: the world sizes asked for (``--gpus``/``--procs``)
checked against this machine, and the backend that goes with them."""
from __future__ import annotations

import os
from dataclasses import dataclass

from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag


@dataclass(frozen=True)
class Plan:
    backend: str
    """nccl (one GPU per process) or gloo (CPU processes)."""
    world_sizes: tuple[int, ...]
    """Processes of each launch, in order."""
    note: str = ""
    """How the world sizes were chosen when they were not given."""

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def plan_worlds(gpus: list[int] | None = None, procs: list[int] | None = None,
                from_one: bool = False) -> Plan:
    """What to launch: ``gpus`` (NCCL, a process per GPU) or ``procs`` (gloo on the CPU), each
    a list of world sizes; neither: every visible GPU when CUDA is there, else 2 CPU
    processes, and 1 before them with ``from_one``. A request this machine cannot run is a
    ``ConfigError`` saying what to give."""
    import torch
    import torch.distributed as dist
    if gpus and procs:
        raise ConfigError(f"give {flag('dist.gpus')} (NCCL on GPUs) or {flag('dist.procs')} (gloo "
                          "on the CPU), not both")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a torch build "
                          "with distributed support (the Linux wheels have it)")
    note = ""
    if not gpus and not procs:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            gpus = sorted({1, count}) if from_one else [count]
            note = (f"all {count} visible GPUs" if count > 1 else "the one visible GPU") \
                + f" ({flag('dist.gpus')} N[,N...] to choose)"
        else:
            procs = [1, 2] if from_one else [2]
            note = f"no GPU here: CPU processes over gloo ({flag('dist.procs')} N[,N...] to choose)"
    if gpus:
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag('dist.gpus')} needs CUDA and torch sees no GPU here; use "
                              f"{flag('dist.procs')} N for gloo on the CPU")
        visible = torch.cuda.device_count()
        if max(gpus) > visible:
            raise ConfigError(f"{flag('dist.gpus')} {max(gpus)}: only {visible} "
                              f"GPU{'s' * (visible != 1)} visible (torch.cuda.device_count()); "
                              f"give at most {visible}")
        if not dist.is_nccl_available():
            raise ConfigError(f"{flag('dist.gpus')} needs NCCL and this torch build has none; use "
                              f"{flag('dist.procs')} N for gloo on the CPU")
        return Plan("nccl", tuple(dict.fromkeys(gpus)), note)
    cores = cpu_cores()
    if max(procs) > 4 * cores:
        raise ConfigError(f"{flag('dist.procs')} {max(procs)}: at most {4 * cores} (4 x the "
                          f"{cores} cores here)")
    if max(procs) > cores:
        warn_once(f"{flag('dist.procs')} {max(procs)} on {cores} cores: processes share cores, and "
                  "the times include that sharing")
    return Plan("gloo", tuple(dict.fromkeys(procs)), note)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
