"""The CPU this process runs on, read from Linux's sysfs and ``/proc/cpuinfo``, and its
matrix-product peak from first principles (cores x clock x FLOP per cycle per core).

``read_cpu_info(root)`` reads a tree rooted at ``root`` (``/`` for this machine; a fake tree in
tests); a file that is missing or unreadable leaves its fields None, never an error.
``cpu_info()`` is this machine's, read once.

The peak (``theoretical_peak``) is the rate of the best matrix-product instructions the CPU
has, for every core this process may run on, at the clock ``CpuInfo`` read. FLOP per cycle per
core, counting a fused multiply-add as 2 FLOP:

=====================  ======  ======================================================
ISA                    FLOP/c  why
=====================  ======  ======================================================
SSE2                   8       4 fp32 lanes, one multiply and one add port
AVX (no FMA)           16      8 fp32 lanes, one multiply and one add port
AVX2 + FMA             32      2 FMA ports x 8 fp32 lanes x 2 (Haswell on; AMD Zen 2 on)
AVX2 + FMA, AMD Zen 1  16      Zen and Zen+ (family 0x17, model < 0x30) split 256-bit
                               operations over 128-bit FMA units
AVX-512F, Intel        64      2 FMA ports x 16 fp32 lanes x 2; ASSUMED: many Xeon Silver
                               and Bronze and most client parts have one 512-bit FMA
                               unit (32)
AVX-512F, AMD Zen 4    32      512-bit instructions run on the two 256-bit FMA units
                               (family 0x19; A. Yee, "Zen4's AVX512 teardown",
                               numberworld.org); Zen 5 (family 0x1A) has 512-bit
                               units: 64
AVX512-BF16            2x      ``vdpbf16ps``: each fp32 lane multiplies a pair of bf16
                               and accumulates both products, twice the fp32 FMA rate
                               of the same vector unit (Intel 128, Zen 4 64)
AMX-BF16               1024    ``tdpbf16ps``: a 16x32 by 32x16 bf16 tile product
                               (8,192 multiply-adds) every 16 cycles, 512 FMA per
                               cycle per core. Intel: "1,024 BF16 operations per
                               cycle, as compared to 64 FP32 operations per cycle"
                               with AVX-512 ("Accelerate AI Workloads with Intel AMX",
                               p. 4, quoted by PyTorch's AMX recipe); operations are
                               FLOP in both figures
=====================  ======  ======================================================

Without bf16 hardware (no AMX-BF16, no AVX512-BF16) a bf16 product is converted to fp32 and
computed by the fp32 units: the bf16 peak is the fp32 one, and the conversions make bf16
slower than fp32 in practice.

The clock is the highest it can run at where known (cpufreq's ``cpuinfo_max_freq``), else the
rated clock in the model name ("@ 2.10GHz", the base clock: turbo runs higher), else
``/proc/cpuinfo``'s "cpu MHz" (the current clock; under a hypervisor, often the nominal one):
``clock_source`` says which. Under sustained vector load most CPUs run below their highest
clock, and some above their base, so a measured rate can be below or above this estimate.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

ISA_FLAGS = ("sse2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
"""The ``/proc/cpuinfo`` flags kasoku reads (those that set a matrix-product rate)."""
PEAK_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class CpuInfo:
    name: str | None = None
    vendor: str | None = None
    """``/proc/cpuinfo``'s vendor_id: GenuineIntel, AuthenticAMD, ..."""
    family: int | None = None
    model: int | None = None
    logical_cpus: int | None = None
    """CPUs the system has (hardware threads)."""
    usable_cpus: int | None = None
    """CPUs this process may run on (its affinity mask)."""
    physical_cores: int | None = None
    """Cores among the usable CPUs (two hardware threads of one core count once)."""
    sockets: int | None = None
    numa_nodes: int | None = None
    l1d_bytes: int | None = None
    """Per core."""
    l2_bytes: int | None = None
    l3_bytes: int | None = None
    """Per instance (shared by the CPUs of a socket or core complex)."""
    clock_ghz: float | None = None
    clock_source: str | None = None
    """``cpufreq max`` | ``model name`` | ``cpu MHz``: where ``clock_ghz`` was read."""
    flags: tuple[str, ...] = ()
    """The ``ISA_FLAGS`` this CPU has."""
    hypervisor: bool = False
    """Running in a virtual machine: the topology and clock are what the hypervisor shows."""

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def amx_bf16(self) -> bool:
        return self.has("amx_bf16") and self.has("amx_tile")

    @property
    def bf16_hardware(self) -> bool:
        """Whether bf16 products run on bf16 units (AMX-BF16 or AVX512-BF16) rather than
        being converted and computed in fp32."""
        return self.amx_bf16 or self.has("avx512_bf16")

    @property
    def bf16_isa(self) -> str | None:
        """The fastest bf16 hardware: "AMX-BF16", "AVX512-BF16" or None."""
        return "AMX-BF16" if self.amx_bf16 else "AVX512-BF16" if self.has("avx512_bf16") \
            else None

    def to_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "bf16_hardware": self.bf16_hardware,
                "bf16_isa": self.bf16_isa}


@dataclass(frozen=True)
class PeakEstimate:
    dtype: str
    flops_per_s: float
    isa: str
    flops_per_cycle_per_core: int
    cores: int
    clock_ghz: float
    clock_source: str | None
    assumptions: str

    def describe(self) -> str:
        """``0.17 TFLOP/s (2 cores x 2.60 GHz x 32 FLOP/cycle, AVX2+FMA)``."""
        return describe_peak(self.to_dict())

    def to_dict(self) -> dict:
        return asdict(self)


def describe_peak(peak: dict) -> str:
    """``PeakEstimate.describe`` of its ``to_dict()``, as results records hold it."""
    return (f"{peak['flops_per_s'] / 1e12:.2f} TFLOP/s ({peak['cores']} cores x "
            f"{peak['clock_ghz']:.2f} GHz x {peak['flops_per_cycle_per_core']} FLOP/cycle, "
            f"{peak['isa']})")


def read_cpu_info(root: str | Path = "/", affinity: set[int] | None = None) -> CpuInfo:
    """The CPU described by the tree at ``root``; ``affinity``: the CPU ids this process may
    run on (None: all of them)."""
    root = Path(root)
    sysfs, blocks, ids = _cpus(root)
    first = blocks[0] if blocks else {}
    usable = sorted(set(ids) & affinity) if affinity is not None and ids else ids
    cores, sockets = _topology({cpu: _core_of(sysfs, blocks, cpu) for cpu in ids}, usable)
    name = first.get("model name")
    clock, source = _clock(sysfs, name, first.get("cpu MHz"))
    present = set(first.get("flags", "").split())
    caches = _caches(sysfs / "cpu0/cache")
    nodes = [p for p in _listdir(root / "sys/devices/system/node")
             if re.fullmatch(r"node\d+", p)]
    return CpuInfo(
        name=name, vendor=first.get("vendor_id"), family=_int(first.get("cpu family")),
        model=_int(first.get("model")), logical_cpus=len(ids) or None,
        usable_cpus=(len(usable) or None) if affinity is not None else (len(ids) or None),
        physical_cores=cores, sockets=sockets, numa_nodes=len(nodes) or None,
        l1d_bytes=caches.get(1), l2_bytes=caches.get(2), l3_bytes=caches.get(3),
        clock_ghz=clock, clock_source=source,
        flags=tuple(f for f in ISA_FLAGS if f in present), hypervisor="hypervisor" in present)


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    try:
        affinity = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        affinity = None
    return read_cpu_info("/", affinity)


def core_cpus(root: str | Path = "/", affinity: set[int] | None = None) -> list[int] | None:
    """One CPU id per physical core among ``affinity`` (None: all CPUs), the lowest of each
    core's hardware threads; None where the topology cannot be read."""
    sysfs, blocks, ids = _cpus(Path(root))
    usable = sorted(set(ids) & affinity) if affinity is not None else ids
    first: dict[tuple[int, int], int] = {}
    for cpu in usable:
        core = _core_of(sysfs, blocks, cpu)
        if core is None:
            return None
        first.setdefault(core, cpu)
    return sorted(first.values()) or None


def theoretical_peak(dtype: str, info: CpuInfo | None = None) -> PeakEstimate | None:
    """The first-principles ``dtype`` ("fp32" or "bf16") matrix-product peak of ``info``
    (default: this machine's) over its usable physical cores; None where the cores, the
    clock or a known vector ISA cannot be read. The table and its sources: the module doc."""
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"no first-principles CPU peak for {dtype!r}; choose one of "
                         f"{', '.join(PEAK_DTYPES)}")
    info = info or cpu_info()
    if not info.physical_cores or not info.clock_ghz:
        return None
    fp32 = _fp32_rate(info)
    if fp32 is None:
        return None
    isa, per_cycle, notes = fp32
    if dtype == "bf16":
        if info.amx_bf16:
            isa, per_cycle, notes = "AMX-BF16", 1024, ["AMX-BF16 tile products: 1024 FLOP/cycle "
                                                       "per core (512 bf16 FMA)"]
        elif info.has("avx512_bf16"):
            units = isa[isa.find(" ("):] if " (" in isa else ""
            isa, per_cycle = f"AVX512-BF16{units}", 2 * per_cycle
            notes = notes + ["vdpbf16ps: twice the fp32 FMA rate of the same units"]
        else:
            notes = notes + ["no bf16 hardware (AMX-BF16, AVX512-BF16): bf16 is converted and "
                             "computed in fp32, so the bf16 peak is the fp32 one"]
    notes.append(_clock_note(info))
    cores = info.physical_cores
    return PeakEstimate(dtype=dtype, flops_per_s=cores * info.clock_ghz * 1e9 * per_cycle,
                        isa=isa, flops_per_cycle_per_core=per_cycle, cores=cores,
                        clock_ghz=info.clock_ghz, clock_source=info.clock_source,
                        assumptions="; ".join(notes))


def _fp32_rate(info: CpuInfo) -> tuple[str, int, list[str]] | None:
    amd = info.vendor == "AuthenticAMD"
    if info.has("avx512f"):
        if amd and info.family is not None and info.family < 0x1A:
            return "AVX-512 (on 256-bit units)", 32, [
                "AMD Zen 4 runs 512-bit instructions on its two 256-bit FMA units: "
                "32 fp32 FLOP/cycle"]
        if amd:
            return "AVX-512", 64, ["AMD Zen 5: two 512-bit FMA units"]
        return "AVX-512", 64, ["ASSUMED two 512-bit FMA units per core (64 fp32 FLOP/cycle); "
                               "parts with one unit (many Xeon Silver and Bronze) reach half"]
    if info.has("avx2") and info.has("fma"):
        if amd and info.family == 0x17 and (info.model or 0) < 0x30:
            return "AVX2+FMA (on 128-bit units)", 16, [
                "AMD Zen/Zen+ run 256-bit FMA on 128-bit units: 16 fp32 FLOP/cycle"]
        return "AVX2+FMA", 32, ["two 256-bit FMA units per core: 32 fp32 FLOP/cycle"]
    if info.has("avx"):
        return "AVX", 16, ["one 256-bit multiply and one add per cycle: 16 fp32 FLOP/cycle"]
    if info.has("sse2"):
        return "SSE2", 8, ["one 128-bit multiply and one add per cycle: 8 fp32 FLOP/cycle"]
    return None


def _clock_note(info: CpuInfo) -> str:
    return {"cpufreq max": f"clock {info.clock_ghz:.2f} GHz: the highest cpufreq allows "
                           "(sustained vector load often runs lower)",
            "model name": f"clock {info.clock_ghz:.2f} GHz: the rated (base) clock in the "
                          "model name (turbo runs higher)",
            "cpu MHz": f"clock {info.clock_ghz:.2f} GHz: /proc/cpuinfo's cpu MHz, the current "
                       "clock" + (" as the hypervisor shows it (often the nominal clock; "
                                  "boost runs higher, so a measured rate may exceed this)"
                                  if info.hypervisor else "")}.get(info.clock_source or "",
                                                                   "clock of unknown source")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError:
        return []


def _int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text.strip(), base) if text is not None else None
    except ValueError:
        return None


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    """``/proc/cpuinfo`` as one dict per processor."""
    blocks, current = [], {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
            current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def _cpus(root: Path) -> tuple[Path, list[dict[str, str]], list[int]]:
    """The sysfs CPU folder under ``root``, ``/proc/cpuinfo``'s blocks and the CPU ids
    (sysfs', else ``/proc/cpuinfo``'s)."""
    sysfs = root / "sys/devices/system/cpu"
    blocks = _cpuinfo_blocks(_read(root / "proc/cpuinfo") or "")
    ids = _cpu_ids(sysfs) or [int(b["processor"]) for b in blocks
                              if b.get("processor", "").isdigit()]
    return sysfs, blocks, ids


def _cpu_ids(sysfs: Path) -> list[int]:
    return sorted(int(m.group(1)) for name in _listdir(sysfs)
                  if (m := re.fullmatch(r"cpu(\d+)", name)))


def _core_of(sysfs: Path, blocks: list[dict], cpu: int) -> tuple[int, int] | None:
    """CPU ``cpu``'s (package, core): sysfs topology, else ``/proc/cpuinfo``'s physical id and
    core id; None where neither says."""
    topo = sysfs / f"cpu{cpu}/topology"
    package, core = _int(_read(topo / "physical_package_id")), _int(_read(topo / "core_id"))
    if package is None or core is None:
        block = next((b for b in blocks if b.get("processor") == str(cpu)), {})
        package, core = _int(block.get("physical id")), _int(block.get("core id"))
    return None if package is None or core is None else (package, core)


def _topology(core_of: dict[int, tuple[int, int] | None], usable: list[int]):
    """(physical cores among ``usable``, sockets among all CPUs: ``core_of``'s keys), None
    where unknown."""
    usable_cores = [core_of[cpu] for cpu in usable]
    cores = None if not usable_cores or None in usable_cores else len(set(usable_cores))
    packages = list(core_of.values())
    sockets = None if not packages or None in packages else len({p for p, _ in packages})
    return cores, sockets


def _clock(sysfs: Path, name: str | None, mhz: str | None) -> tuple[float | None, str | None]:
    khz = _int(_read(sysfs / "cpu0/cpufreq/cpuinfo_max_freq"))
    if khz:
        return khz / 1e6, "cpufreq max"
    rated = re.search(r"@\s*([\d.]+)\s*GHz", name or "")
    if rated:
        return float(rated.group(1)), "model name"
    try:
        return (float(mhz) / 1e3, "cpu MHz") if mhz else (None, None)
    except ValueError:
        return None, None


def _caches(folder: Path) -> dict[int, int]:
    """{level: bytes} of cpu0's data and unified caches."""
    sizes = {}
    for index in _listdir(folder):
        level = _int(_read(folder / index / "level"))
        kind = (_read(folder / index / "type") or "").strip()
        size = _size_bytes((_read(folder / index / "size") or "").strip())
        if level and size and kind in ("Data", "Unified"):
            sizes[level] = size
    return sizes


def _size_bytes(text: str) -> int | None:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", text)
    if not m:
        return None
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]
