"""The CPU's threads as a lever: PyTorch's intra-op threads one per physical core, few
inter-op threads, and this process pinned to one hardware thread of each of those cores.

This is the recipe of ``torch.backends.xeon.run_cpu`` (PyTorch's CPU launcher): OMP threads =
the physical cores used, no logical cores unless asked (``--use-logical-core``), each thread
on a core of its own. A core's second hardware thread shares its FMA units, so it adds no
matrix-product rate, and the two threads compete for the core's caches. Inter-op threads run
independent operators side by side; a training step's operators depend on each other, so one
is enough and more only take cores from the intra-op threads.

Where no thread count is asked for, the cores another process keeps busy are left out
(``kasoku.perf.noise.free_cpus``, watched for a twentieth of a second): on a 2-core machine
with one core busy elsewhere, two threads that wait on each other at every operator ran the
MNIST MLP 20x slower than one thread on the free core.

Call it at the start of a process, before PyTorch runs any parallel work: the inter-op
thread count can be set only once, and only before then.
"""
from __future__ import annotations

import os

import torch

from kasoku.perf.cpuinfo import core_cpus, cpu_info
from kasoku.perf.noise import free_cpus

INTEROP_THREADS = 1


def default_threads() -> int:
    """One thread per physical core this process may run on (else per usable CPU)."""
    info = cpu_info()
    return info.physical_cores or info.usable_cpus or os.cpu_count() or 1


def apply_cpu_threads(threads: int | None = None, interop_threads: int = INTEROP_THREADS,
                      pin: bool = True, avoid_busy: bool = True) -> dict:
    """Set PyTorch's intra-op threads to ``threads`` (None: ``default_threads()``, less the
    cores other processes keep busy when ``avoid_busy``) and its inter-op threads to
    ``interop_threads``; with ``pin`` and no more threads than physical cores, restrict this
    process to one hardware thread per core (the free ones). Returns what was set, for a
    results record: ``{"threads", "interop_threads", "pinned_cpus", "busy_cpus", "note"}``
    (``pinned_cpus`` None when the affinity was left as it was; ``busy_cpus``: ``{cpu: busy
    share}`` of the cores left out, or seen busy when all were)."""
    free, busy = _free_cores() if avoid_busy else (None, {})
    if threads is None:
        threads = len(free) if free and busy else default_threads()
    if threads < 1 or interop_threads < 1:
        raise ValueError(f"threads and inter-op threads must be >= 1, got {threads} and "
                         f"{interop_threads}")
    # The free cores first: a thread count below the cores' leaves the busy ones out.
    order = free + sorted(busy) if free is not None else None
    pinned = _pin_to_cores(threads, order) if pin else None
    note = _busy_note(busy, pinned)
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != interop_threads:
        try:
            torch.set_num_interop_threads(interop_threads)
        except RuntimeError:  # inter-op work ran already: the pool keeps its size
            pass
    return {"threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "pinned_cpus": pinned,
            "busy_cpus": {str(c): round(v, 3) for c, v in busy.items()}, "note": note}


def _free_cores() -> tuple[list[int] | None, dict[int, float]]:
    """One CPU per physical core of the affinity, split: ``(the ones no other process keeps
    busy, or None when unknown; {cpu: busy share} of the others)``."""
    try:
        affinity = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None, {}
    cpus = core_cpus("/", affinity) or sorted(affinity)
    return free_cpus(cpus)


def _busy_note(busy: dict[int, float], pinned: list[int] | None) -> str | None:
    if not busy:
        return None
    taken = ", ".join(f"CPU {c} ({100 * v:.0f}% busy)" for c, v in sorted(busy.items()))
    where = f"; kasoku's threads on CPUs {pinned}" if pinned else ""
    return f"other processes kept {taken} busy when the run started{where}"


def _pin_to_cores(threads: int, order: list[int] | None = None) -> list[int] | None:
    """Pin to the first ``threads`` cores' first hardware threads (of ``order``, one CPU per
    core, where given), where the affinity holds more CPUs than that (a second hardware
    thread of a core, or more cores than threads)."""
    try:
        affinity = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    cpus = core_cpus("/", affinity)
    if not cpus or threads > len(cpus) or len(affinity) == threads:
        return None  # unknown topology, oversubscribed on purpose, or nothing to narrow
    chosen = sorted((order or cpus)[:threads])
    try:
        os.sched_setaffinity(0, chosen)
    except OSError:
        return None
    return chosen
