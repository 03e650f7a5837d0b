"""How far a timed figure can be trusted: its spread over the timed windows, and what the
machine was doing while they ran.

A figure is *stable* when its windows agree (``spread``: the range over the median, the
fastest and slowest window left out from 6 windows on, at most ``SPREAD_LIMIT``) and no other
process took a real share of the CPUs the run used (``MachineWatch``: at least
``OTHERS_LIMIT`` of the run's cores on average, or ``GPU_OTHERS`` another process on its GPU).
Otherwise it is marked unstable with the reason, and nothing is concluded from a difference
within its range (``Spread.overlaps``).

The machine is read from ``/proc`` (Linux): each CPU's busy time (``/proc/stat``), every
process's CPU time and the CPU it last ran on (``/proc/PID/stat``), the load average; the
GPU's clocks and other processes through NVML (``pynvml``) where it can be imported. Where a
reading is missing, the figure carries no claim about it (``None``), never a guess.

kasoku's own code: psutil would read the same counters, but it is one more dependency for
three files of ``/proc``, and it has no notion of which CPUs a run used.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

SPREAD_LIMIT = 0.10
"""A figure whose windows range over more than 10% of their median is unstable."""
OTHERS_LIMIT = 0.25
"""Other processes using a quarter of a core of the run's CPUs on average make it unstable
(on a 2-core machine, one busy core halves what PyTorch's threads get)."""
CPU_TAKEN = 0.5
"""A CPU busy at least half the time with other processes is taken (``free_cpus``)."""
MIN_WINDOWS_FOR_TRIM = 6

_PROC = Path("/proc")


@dataclass(frozen=True)
class Spread:
    """The median of some timed values and how far they range."""
    median: float
    min: float
    max: float
    n: int
    spread: float
    """(max - min) / median of the values kept (from 6 on, the two extremes left out)."""

    @property
    def stable(self) -> bool:
        return self.spread <= SPREAD_LIMIT

    def overlaps(self, other: "Spread") -> bool:
        """Whether the two ranges meet: a difference between them is within the noise."""
        return self.min <= other.max and other.min <= self.max

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n,
                "spread": self.spread}


def spread(values: Sequence[float]) -> Spread:
    """``Spread`` of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread of no values")
    values = sorted(values)
    kept = values[1:-1] if len(values) >= MIN_WINDOWS_FOR_TRIM else values
    med = statistics.median(values)
    rel = (kept[-1] - kept[0]) / med if med > 0 else 0.0
    return Spread(med, values[0], values[-1], len(values), rel)


# --- the machine ----------------------------------------------------------------------------

def _cpu_jiffies() -> dict[int, tuple[int, int]] | None:
    """``{cpu: (busy, total)}`` clock ticks from ``/proc/stat``."""
    try:
        lines = (_PROC / "stat").read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *fields = line.split()
            ticks = [int(x) for x in fields[:8]]
            idle = ticks[3] + ticks[4]  # idle + iowait
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def _processes() -> dict[int, tuple[str, float, int]]:
    """``{pid: (name, CPU seconds, last CPU)}`` of every process that can be read."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        entries = [p for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return out
    for entry in entries:
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / hz,
                                int(fields[36]))
    return out


def _tree(pids: Iterable[int]) -> set[int]:
    """``pids`` and all their descendants (``/proc/PID/task/*/children``)."""
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for task in (_PROC / str(pid) / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return seen


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


@dataclass
class MachineState:
    """What the machine did during a measurement of ``wall_s`` seconds on ``cpus``."""
    wall_s: float
    cpus: list[int]
    others_cores: float | None
    """CPU time other processes used on ``cpus``, in cores (None: /proc unreadable)."""
    cpu_busy: dict[int, float] = field(default_factory=dict)
    """Each CPU's busy share, all processes (ours too)."""
    top_others: list[dict] = field(default_factory=list)
    """The other processes that used the most CPU: pid, name, cores, last CPU."""
    load_avg: float | None = None
    gpu: dict | None = None

    def reasons(self) -> list[str]:
        """Why the figure cannot be trusted, from the machine alone ([] if it can)."""
        out = []
        limit = max(OTHERS_LIMIT, 0.1 * len(self.cpus))
        if self.others_cores is not None and self.others_cores >= limit:
            who = ", ".join(_who(p) for p in self.top_others[:2])
            out.append(f"other processes used {self.others_cores:.2f} cores of the run's "
                       f"{len(self.cpus)} (CPUs {_cpu_list(self.cpus)})"
                       + (f": {who}" if who else ""))
        for proc in (self.gpu or {}).get("others", []):
            out.append(f"another process on the GPU: pid {proc['pid']}"
                       + (f", {proc['mem_gib']:.1f} GiB" if proc.get("mem_gib") else ""))
        return out

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "cpus": self.cpus, "others_cores": self.others_cores,
                "cpu_busy": {str(k): v for k, v in self.cpu_busy.items()},
                "top_others": self.top_others, "load_avg": self.load_avg,
                "cores": len(self.cpus), "gpu": self.gpu}


def _who(proc: dict) -> str:
    last = f", last on CPU {proc['cpu']}" if proc.get("cpu") is not None else ""
    return f"{proc['name']} (pid {proc['pid']}, {100 * proc['cores']:.0f}% of a core{last})"


def _cpu_list(cpus: Sequence[int]) -> str:
    """``cpus`` as a CPU list with runs of three or more as ranges (0-63,65,68,69)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


class MachineWatch:
    """Reads the machine at ``start()`` and ``stop()`` (``MachineState``): the CPU time of
    processes other than ``own`` (default: this process and its children, read at stop) on
    the CPUs ``cpus`` (default: this process's affinity), and, with a CUDA ``device``, the
    GPU's clocks and other processes."""

    def __init__(self, cpus: Iterable[int] | None = None, own: Iterable[int] | None = None,
                 device=None):
        self.cpus = sorted(cpus) if cpus is not None else None
        self.own = list(own) if own is not None else None
        self.device = device

    def start(self) -> "MachineWatch":
        self._t0 = time.perf_counter()
        self._jiffies = _cpu_jiffies()
        self._procs = _processes()
        return self

    def stop(self) -> MachineState:
        wall = time.perf_counter() - self._t0
        jiffies, procs = _cpu_jiffies(), _processes()
        cpus = self.cpus if self.cpus is not None else sorted(_affinity())
        own = _tree(self.own if self.own is not None else [os.getpid()])
        hz = os.sysconf("SC_CLK_TCK")
        state = MachineState(wall, cpus, None, load_avg=_load_avg())
        if self._jiffies and jiffies and wall > 0:
            busy = {c: (jiffies[c][0] - self._jiffies[c][0])
                    / max(1, jiffies[c][1] - self._jiffies[c][1])
                    for c in jiffies if c in self._jiffies}
            state.cpu_busy = busy
            used = sum(jiffies[c][0] - self._jiffies[c][0] for c in cpus if c in jiffies) / hz
            ours = sum(procs[p][1] - self._procs[p][1] for p in own
                       if p in procs and p in self._procs)
            state.others_cores = max(0.0, (used - ours) / wall)
        others = [(pid, procs[pid][0], (procs[pid][1] - self._procs[pid][1]) / max(wall, 1e-9),
                   procs[pid][2]) for pid in procs.keys() & self._procs.keys() if pid not in own]
        state.top_others = [{"pid": pid, "name": name, "cores": cores, "cpu": cpu}
                            for pid, name, cores, cpu in
                            sorted(others, key=lambda o: -o[2])[:3] if cores >= 0.05]
        if self.device is not None and str(self.device).startswith("cuda"):
            state.gpu = gpu_state(self.device, own)
        return state


def job_pids() -> list[int]:
    """The processes of this run: under a launcher (``TORCHELASTIC_RUN_ID``) the launcher's
    whole tree, so the other workers are not counted as other processes; else this one."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return [os.getppid()]
    return [os.getpid()]


def marked(text: str, stability: dict | None) -> str:
    """``text`` with ``!`` when ``stability`` (``Stability.to_dict``) says unstable."""
    return text + ("!" if stability and not stability.get("stable", True) else "")


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def gpu_state(device, own: set[int] | None = None) -> dict | None:
    """The GPU's SM clock (now and its maximum) and the other processes on it, through NVML;
    None where NVML cannot be read."""
    try:
        import pynvml  # optional: nvidia-ml-py, on machines with an NVIDIA driver
        import torch
        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        uuid = torch.cuda.get_device_properties(index).uuid
        handle = next(h for h in (pynvml.nvmlDeviceGetHandleByIndex(i)
                                  for i in range(pynvml.nvmlDeviceGetCount()))
                      if str(uuid) in str(pynvml.nvmlDeviceGetUUID(h)))
        own = own or _tree([os.getpid()])
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle,
                                                                      pynvml.NVML_CLOCK_SM),
                "others": [{"pid": p.pid, "mem_gib": (p.usedGpuMemory or 0) / 2**30}
                           for p in procs if p.pid not in own]}
    except Exception:  # noqa: BLE001 - no NVML, no driver, no permission: no claim
        return None


def free_cpus(cpus: Iterable[int], sample_s: float = 0.05) -> tuple[list[int], dict[int, float]]:
    """The CPUs of ``cpus`` that other processes leave free, watched for ``sample_s`` seconds
    while this process waits: ``(free, {cpu: busy share} of the taken ones)``. A CPU is taken
    when it is busy at least ``CPU_TAKEN`` of the time; all of them free when /proc cannot be
    read."""
    cpus = sorted(cpus)
    before = _cpu_jiffies()
    time.sleep(sample_s)
    after = _cpu_jiffies()
    if not before or not after:
        return cpus, {}
    taken = {}
    for c in cpus:
        if c in before and c in after:
            share = (after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1])
            if share >= CPU_TAKEN:
                taken[c] = share
    return [c for c in cpus if c not in taken], taken


@dataclass
class Stability:
    """A timed figure's verdict on itself: ``stable``, and the reasons when not."""
    spread: Spread
    machine: MachineState | None = None
    extra_windows: int = 0
    """Windows taken beyond the ones asked for, because the first ones disagreed."""

    @property
    def reasons(self) -> list[str]:
        out = []
        if not self.spread.stable:
            out.append(f"its {self.spread.n} windows range over {100 * self.spread.spread:.0f}% "
                       f"of their median (more than {100 * SPREAD_LIMIT:.0f}%)")
        if self.machine is not None:
            out += self.machine.reasons()
        return out

    @property
    def stable(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        return {"stable": self.stable, "reasons": self.reasons, **self.spread.to_dict(),
                "extra_windows": self.extra_windows,
                "machine": self.machine.to_dict() if self.machine else None}


def ranges_meet(s: dict, t: dict) -> bool:
    """Whether two rates' windows' ranges (``{"min", "max"}``) meet: their difference is no
    result."""
    return s["min"] <= t["max"] and t["min"] <= s["max"]
