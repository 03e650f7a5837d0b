"""CPU time of a group of processes, for "cores busy" figures: a loader's own process plus its
worker processes, read before and after a timed span.

The calling process is read with ``time.process_time`` (all its threads, fine-grained); other
processes from ``/proc/<pid>/stat`` (user + system time of all their threads, in clock ticks,
usually 10 ms: spans of a second or more keep that error small). Where ``/proc`` is missing
other processes cannot be read and are left out: ``busy_cores`` counts only the processes
read at both ends of the span.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable

_PROC = Path("/proc")


def process_cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds that process ``pid`` (default: this one) has used so far, or
    None when it cannot be read (the process has exited, or no ``/proc`` for another process)."""
    if pid is None or pid == os.getpid():
        return time.process_time()  # every thread of this process, to the nanosecond
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ")": the fields
    # after the last ")" start at field 3 (state); utime and stime are fields 14 and 15.
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """``{pid: CPU seconds so far}`` of the processes in ``pids`` that can be read."""
    times = {}
    for pid in pids:
        seconds = process_cpu_seconds(pid)
        if seconds is not None:
            times[pid] = seconds
    return times


def busy_cores(before: dict[int, float], after: dict[int, float], wall_s: float) -> float:
    """Cores kept busy on average over a span of ``wall_s`` seconds: the CPU seconds the
    processes read at both ends (``cpu_seconds``) used in between, divided by ``wall_s``."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be positive, got {wall_s}")
    used = sum(after[pid] - before[pid] for pid in before.keys() & after.keys())
    return used / wall_s


def usable_cores() -> int:
    """The cores this process may run on (its affinity), the most it can keep busy."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1
