"""The CPU's cores shared out between the training step and the loader's workers: the step's
threads on the first cores, the worker processes (or threads) of ``--loader multiprocess:N``
and ``threads:N`` on the last ones, so that neither preempts the other.

This completes ``torch.backends.xeon.run_cpu``'s recipe (``kasoku.accel.cpu_threads``: one
intra-op thread per physical core, each on a core of its own) for a run that also decodes:
run_cpu hands each instance a contiguous slice of the sorted physical cores
(``--ncores-per-instance``); here the step is one slice and the loader the other. Without the
split, PyTorch's threads take every core and the workers land on the same ones; an OpenMP
thread preempted by a decode holds up the whole parallel region at its barrier. The split
costs the step the workers' cores: where the loader has little to do (an in-memory dataset
whose batch is one gather), a compute-bound step runs slower by their share, and
``--no-loader-cores`` gives them back.

How many cores the workers get, of the C physical cores this process may use: with no
thread count asked for, one per worker and at most a quarter, ``min(N, C // 4)``, so the step
keeps three quarters or more (on a CPU it is most of the work; a loader that needs more takes
fewer workers and gives nothing back). Below 4 cores that quarter is less than one core, and a
whole core would cost the step half its compute or more: measured on the 2-core VM,
``mnist-mlp`` fed by ``multiprocess:1`` ran 16.9 ms per step split 1 + 1 against 11.0 ms with
the cores shared, when the machine was quiet (under another job's load the shared run
collapsed to several times that in 3 of 10 runs, the split one did not). So there the cores
stay shared unless a thread count is asked for: with ``threads`` T the step keeps T cores and
the workers take up to N of the C - T others (``--threads 1`` on 2 cores: 1 + 1). Fewer than 2
cores, or T >= C: no split. Like
run_cpu without ``--use-logical-core``, each side uses one hardware thread per core. On a
machine of several NUMA nodes the worker cores are the last node's; the step's span nodes,
as they did before the split (run_cpu's ``--skip-cross-node-cores`` concerns instances
of a fixed size, which this is not).

Pinning happens where the affinity API allows (Linux): this process's threads, all of them
(a thread keeps the mask it was created with, so PyTorch's OpenMP pool, once started, does
not follow the main thread), then each worker pins itself as it starts
(``kasoku.data.parallel_loader``). Where the API is missing or refuses, nothing is changed and
the record says why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kasoku.core.flags import flag
from kasoku.data.registry import host_workers
from kasoku.perf.cpuinfo import core_cpus

MIN_CORES = 4
"""Fewer physical cores than this: no split unless a thread count is asked for (the module
doc says why)."""


@dataclass(frozen=True)
class CoreSplit:
    compute_cpus: tuple[int, ...]
    """One CPU id per core of the training step (its intra-op threads: one per core)."""
    worker_cpus: tuple[int, ...]
    """One CPU id per core of the loader's workers."""


def split_cores(cpus: list[int], num_workers: int, threads: int | None = None
                ) -> CoreSplit | str:
    """The split of ``cpus`` (one CPU id per physical core, in order: ``core_cpus``) between
    the step and ``num_workers`` loader workers (see the module doc), or a sentence saying why
    there is none. ``threads``: the step's thread count asked for (None: the cores it gets)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be None or >= 1, got {threads}")
    cores = len(cpus)
    if cores < 2:
        return f"{cores} physical core{'s' * (cores != 1)} usable: nothing to split"
    if threads is not None and threads >= cores:
        return (f"the {threads} compute threads asked for take all {cores} physical cores "
                f"usable")
    if threads is None and cores < MIN_CORES:
        return (f"{cores} physical cores usable: a core for the workers would cost the step half "
                f"its compute or more, so they share them ({flag('train.threads')} T splits "
                "anyway: the step on T cores, the workers on the others)")
    workers = min(num_workers, cores - threads) if threads else min(num_workers, cores // 4)
    step = threads or cores - workers
    return CoreSplit(tuple(cpus[:step]), tuple(cpus[cores - workers:]))


def apply_loader_cores(num_workers: int, threads: int | None = None,
                       affinity: set[int] | None = None) -> dict:
    """Split the cores of ``affinity`` (None: this process's mask; a caller that has pinned
    the process already passes the mask it had) between the step and ``num_workers`` loader
    workers (``split_cores``): pin every thread of this process to the step's cores and set
    PyTorch's intra-op threads to ``threads`` or else one per step core. Call it before the
    loader is built, hand the loader ``worker_cpus`` = the record's ``loader_cpus``, and call
    ``release_cores(record)`` when the run is over. Returns a record for the run:
    ``{"threads", "threads_before" (PyTorch's thread count before), "pinned_cpus" (the
    step's), "loader_workers", "loader_cpus", "loader_note":
    None, "affinity_cpus" (the mask split)}``, or where nothing was changed
    ``{"loader_workers", "loader_cpus": None, "loader_note": why}`` (``shared_cores``)."""
    try:
        affinity = os.sched_getaffinity(0) if affinity is None else set(affinity)
    except (AttributeError, OSError):
        return shared_cores(num_workers, "no CPU affinity API on this platform")
    cpus = core_cpus("/", affinity)
    if not cpus:
        return shared_cores(num_workers, "the CPU topology could not be read")
    split = split_cores(cpus, num_workers, threads)
    if isinstance(split, str):
        return shared_cores(num_workers, split)
    if not pin_threads(split.compute_cpus):
        return shared_cores(num_workers, "this process could not be pinned to CPUs "
                                         f"{list(split.compute_cpus)}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads or len(split.compute_cpus))
    return {"threads": torch.get_num_threads(), "threads_before": before,
            "pinned_cpus": list(split.compute_cpus),
            "loader_workers": num_workers, "loader_cpus": list(split.worker_cpus),
            "loader_note": None, "affinity_cpus": sorted(affinity)}


def loader_split(spec: str, device_type: str, on: bool = True, threads: int | None = None,
                 affinity: set[int] | None = None) -> dict | None:
    """The cores of a run whose loader is ``spec`` on ``device_type``: None where the loader
    runs no workers on the host or the run is not on a CPU; else ``apply_loader_cores``' record
    (``on``), or the record of shared cores saying ``--no-loader-cores``. What ``kasoku
    train`` and bench's loader rung both decide, before the loader is built."""
    workers = host_workers(spec) if device_type == "cpu" else 0
    if not workers:
        return None
    if not on:
        return shared_cores(workers, flag("train.loader_cores"))
    return apply_loader_cores(workers, threads, affinity)


def release_cores(record: dict | None) -> None:
    """Put this process's threads back on the CPUs ``apply_loader_cores`` split (its
    record's ``affinity_cpus``) and PyTorch's thread count back to ``threads_before``, so
    that a library call leaves its caller's threads as it found them; nothing for a record of
    shared cores, or None."""
    if record and record.get("affinity_cpus"):
        pin_threads(record["affinity_cpus"])
        if record.get("threads_before"):
            torch.set_num_threads(record["threads_before"])


def shared_cores(num_workers: int, why: str) -> dict:
    """The record of a run whose loader workers share the step's cores, and ``why``."""
    return {"loader_workers": num_workers, "loader_cpus": None, "loader_note": why}


def describe(record: dict) -> str:
    """``1 compute thread on CPUs [0], 1 loader worker on CPUs [1]`` (or where the cores are
    shared: ``1 loader worker on the compute cores (why)``)."""
    workers = record["loader_workers"]
    said = f"{workers} loader worker{'s' * (workers != 1)}"
    if not record.get("loader_cpus"):
        return f"{said} on the compute cores ({record['loader_note']})"
    threads = record["threads"]
    return (f"{threads} compute thread{'s' * (threads != 1)} on CPUs {record['pinned_cpus']}, "
            f"{said} on CPUs {record['loader_cpus']}")


def pin_threads(cpus) -> bool:
    """Pin every thread of this process to ``cpus``; False (and nothing changed for the
    calling thread) where the affinity API is missing or refuses. Threads that end meanwhile
    are skipped."""
    try:
        os.sched_setaffinity(0, cpus)  # the calling thread first: it decides success
    except (AttributeError, OSError):
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the threads started from now on follow the calling thread
        return True
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # ended since listed
            pass
    return True
