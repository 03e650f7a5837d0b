"""kasoku.perf.cpuinfo: the CPU read from fake sysfs and /proc trees, and the first-principles
peak's arithmetic."""
from __future__ import annotations

from pathlib import Path

import pytest

from kasoku.perf.cpuinfo import CpuInfo, cpu_info, read_cpu_info, theoretical_peak

XEON_FLAGS = ("fpu sse sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 "
              "amx_bf16 amx_tile amx_int8")
EPYC_FLAGS = "fpu sse sse2 avx avx2 fma hypervisor"


def fake_tree(root: Path, *, name: str, vendor: str, family: int, model: int, flags: str,
              topology: list[tuple[int, int]], nodes: int = 1, max_khz: int | None = None,
              mhz: float = 2000.0, caches=(("1", "Data", "48K"), ("1", "Instruction", "32K"),
                                            ("2", "Unified", "2048K"),
                                            ("3", "Unified", "105M"))) -> Path:
    """A /proc/cpuinfo and /sys tree: ``topology[i]`` is CPU i's (package, core)."""
    blocks = []
    for cpu, (package, core) in enumerate(topology):
        blocks.append(f"processor\t: {cpu}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                      f"model\t\t: {model}\nmodel name\t: {name}\ncpu MHz\t\t: {mhz}\n"
                      f"physical id\t: {package}\ncore id\t\t: {core}\nflags\t\t: {flags}\n")
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    (root / "proc").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text("\n".join(blocks) + "\n")
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"sys/devices/system/cpu/cpu0/cache/index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(level + "\n")
        (index / "type").write_text(kind + "\n")
        (index / "size").write_text(size + "\n")
    for n in range(nodes):
        (root / f"sys/devices/system/node/node{n}").mkdir(parents=True)
    if max_khz:
        freq = root / "sys/devices/system/cpu/cpu0/cpufreq"
        freq.mkdir(parents=True)
        (freq / "cpuinfo_max_freq").write_text(f"{max_khz}\n")
    return root


@pytest.fixture
def xeon(tmp_path):
    # 2 sockets x 4 cores x 2 threads; CPU i and i + 8 share a core, as Linux numbers them.
    cores = [(s, c) for s in range(2) for c in range(4)]
    return fake_tree(tmp_path, name="Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz",
                     vendor="GenuineIntel", family=6, model=143, flags=XEON_FLAGS,
                     topology=cores + cores, nodes=2)


@pytest.fixture
def epyc(tmp_path):
    return fake_tree(tmp_path, name="AMD EPYC 7B13", vendor="AuthenticAMD", family=25,
                     model=1, flags=EPYC_FLAGS, topology=[(0, 0), (0, 1)], mhz=2450.0,
                     caches=(("1", "Data", "32K"), ("2", "Unified", "512K"),
                             ("3", "Unified", "32768K")))


def test_amx_xeon(xeon):
    info = read_cpu_info(xeon)
    assert (info.vendor, info.logical_cpus, info.usable_cpus) == ("GenuineIntel", 16, 16)
    assert (info.physical_cores, info.sockets, info.numa_nodes) == (8, 2, 2)
    assert (info.l1d_bytes, info.l2_bytes, info.l3_bytes) == (48 << 10, 2 << 20, 105 << 20)
    assert (info.clock_ghz, info.clock_source) == (2.0, "model name")
    assert info.amx_bf16 and info.bf16_hardware and not info.hypervisor
    assert set(info.flags) >= {"avx512f", "amx_bf16", "amx_tile", "avx512_fp16"}
    assert info.to_dict()["bf16_hardware"] is True


def test_affinity_counts_cores_once(xeon):
    # CPUs 0 and 8 are one core's two threads; CPU 1 another core.
    info = read_cpu_info(xeon, affinity={0, 8, 1})
    assert (info.usable_cpus, info.physical_cores, info.logical_cpus) == (3, 2, 16)


def test_cpufreq_max_wins(tmp_path):
    root = fake_tree(tmp_path, name="Intel(R) Xeon(R) @ 2.00GHz", vendor="GenuineIntel",
                     family=6, model=143, flags=XEON_FLAGS, topology=[(0, 0)], max_khz=3800000)
    info = read_cpu_info(root)
    assert (info.clock_ghz, info.clock_source) == (3.8, "cpufreq max")


def test_avx2_epyc_has_no_bf16_hardware(epyc):
    info = read_cpu_info(epyc)
    assert (info.physical_cores, info.sockets, info.numa_nodes) == (2, 1, 1)
    assert (info.clock_ghz, info.clock_source) == (2.45, "cpu MHz")
    assert info.hypervisor and not info.bf16_hardware and not info.has("avx512f")
    assert info.l3_bytes == 32 << 20


def test_missing_files_give_none(tmp_path):
    info = read_cpu_info(tmp_path)
    assert info == CpuInfo()
    assert theoretical_peak("fp32", info) is None
    # /proc/cpuinfo alone (no sysfs): cores from its physical id / core id lines.
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(
        "processor\t: 0\nphysical id\t: 0\ncore id\t: 0\nflags\t: avx2 fma\n\n"
        "processor\t: 1\nphysical id\t: 0\ncore id\t: 0\nflags\t: avx2 fma\n")
    info = read_cpu_info(tmp_path)
    assert (info.logical_cpus, info.physical_cores, info.sockets) == (2, 1, 1)
    assert info.clock_ghz is None and info.numa_nodes is None and info.name is None


def test_this_machine_reads_without_error():
    info = cpu_info()
    assert info is cpu_info()  # read once
    assert info.to_dict()["flags"] == list(info.flags)


def test_peak_arithmetic():
    avx2 = CpuInfo(vendor="AuthenticAMD", family=25, model=1, physical_cores=2,
                   clock_ghz=2.5, clock_source="cpu MHz", flags=("avx", "avx2", "fma"))
    fp32 = theoretical_peak("fp32", avx2)
    assert (fp32.flops_per_cycle_per_core, fp32.isa) == (32, "AVX2+FMA")
    assert fp32.flops_per_s == pytest.approx(2 * 2.5e9 * 32)
    bf16 = theoretical_peak("bf16", avx2)  # no bf16 hardware: the fp32 units
    assert bf16.flops_per_s == fp32.flops_per_s and "no bf16 hardware" in bf16.assumptions

    xeon = CpuInfo(vendor="GenuineIntel", family=6, model=143, physical_cores=16,
                   clock_ghz=2.0, flags=("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile",
                                         "amx_bf16"))
    assert theoretical_peak("fp32", xeon).flops_per_cycle_per_core == 64
    assert "ASSUMED two 512-bit FMA" in theoretical_peak("fp32", xeon).assumptions
    amx = theoretical_peak("bf16", xeon)
    assert (amx.isa, amx.flops_per_cycle_per_core) == ("AMX-BF16", 1024)
    assert amx.flops_per_s == pytest.approx(16 * 2.0e9 * 1024)
    assert "32.77 TFLOP/s (16 cores x 2.00 GHz" in amx.describe()

    zen4 = CpuInfo(vendor="AuthenticAMD", family=25, model=17, physical_cores=2,
                   clock_ghz=2.6, flags=("avx2", "fma", "avx512f", "avx512_bf16"))
    assert theoretical_peak("fp32", zen4).flops_per_cycle_per_core == 32
    assert theoretical_peak("bf16", zen4).flops_per_cycle_per_core == 64
    zen1 = CpuInfo(vendor="AuthenticAMD", family=0x17, model=1, physical_cores=8,
                   clock_ghz=3.0, flags=("avx2", "fma"))
    assert theoretical_peak("fp32", zen1).flops_per_cycle_per_core == 16


def test_peak_refuses_unknown_dtype():
    with pytest.raises(ValueError, match="fp32, bf16"):
        theoretical_peak("fp16", CpuInfo())


def test_core_cpus_takes_the_first_thread_of_each_core(xeon):
    from kasoku.perf.cpuinfo import core_cpus
    assert core_cpus(xeon) == list(range(8))  # CPUs 8..15 are the second threads
    assert core_cpus(xeon, affinity={9, 10, 2}) == [2, 9]
    assert core_cpus(xeon.parent / "missing") is None
