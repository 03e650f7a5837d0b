"""The CPU ladder made for the CPU it runs on: bf16 skipped without bf16 hardware (with the
reason in the table), forced by name; threads one per physical core; the peaks, skipped and
slower rungs under the table."""
from __future__ import annotations

import io
import os

import pytest
import torch

from kasoku.accel.cpu_threads import apply_cpu_threads, default_threads
from kasoku.commands.bench import report
from kasoku.commands.bench import rungs as rungs_mod
from kasoku.commands.bench.rungs import NO_BF16_HARDWARE, PLAIN, cpu_ladder, resolve, rung_from_spec
from kasoku.commands.bench.sweep import SweepConfig, run_sweep
from kasoku.perf.cpuinfo import CpuInfo

AVX2 = CpuInfo(vendor="AuthenticAMD", family=25, model=1, physical_cores=2, clock_ghz=2.5,
               flags=("avx", "avx2", "fma"))
AMX = CpuInfo(vendor="GenuineIntel", family=6, model=143, physical_cores=16, clock_ghz=2.0,
              flags=("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))


def test_no_bf16_hardware_skips_bf16_and_keeps_the_rest_in_fp32():
    ladder = cpu_ladder(AVX2)
    by = {r.label: r for r in ladder}
    assert by["+bf16"].skip == NO_BF16_HARDWARE and "no bf16 hardware" in NO_BF16_HARDWARE
    assert by["+compile"].config.precision == "fp32" and by["+compile"].config.compile
    assert by["+compile"].config.optimizer_impl == "fused" and by["+compile"].config.keep_memory
    assert all(r.skip is None for r in ladder if r.label != "+bf16")
    rungs, notes = resolve(ladder, "cpu", has_conv=False)
    # +channels_last, without its lever on an MLP, equals +fused (not the skipped +bf16).
    assert [r.label for r in rungs] == ["plain", "fp32", "+fused", "+keep-memory", "+bf16",
                                        "+compile"]
    assert any("+channels_last skipped: without channels_last it equals rung +keep-memory"
               in n for n in notes)


def test_bf16_hardware_keeps_the_bf16_rungs():
    ladder = cpu_ladder(AMX)
    assert all(r.skip is None for r in ladder)
    assert {r.label: r.config for r in ladder[1:]}["+compile"].precision == "bf16"


def test_a_rung_named_with_config_is_measured_anyway(monkeypatch):
    monkeypatch.setattr(rungs_mod, "cpu_info", lambda: AVX2)
    assert {r.label: r for r in cpu_ladder()}["+bf16"].skip  # the sweep's ladder here
    forced = rung_from_spec("+bf16", "cpu")
    assert forced.skip is None and forced.config.precision == "bf16"


def test_the_sweep_records_a_skipped_rung_and_the_table_says_why(tmp_path):
    skipped = {r.label: r for r in cpu_ladder(AVX2)}["+bf16"]
    cfg = SweepConfig("mnist-mlp", (skipped,), (8,), tmp_path, numerics_steps=0,
                      profile_steps=0, threads=1, peak_size=64)
    text = io.StringIO()
    result = run_sweep(cfg, stream=text)
    (record,) = result.records
    assert record["status"] == "skipped" and record["error"] == NO_BF16_HARDWARE
    assert result.exit_code == 0
    table = text.getvalue()
    assert "skipped rungs:" in table and f"+bf16: {NO_BF16_HARDWARE}" in table
    assert (tmp_path / "results.jsonl").read_text().count('"skipped"') == 1


def _record(rung, median, spread, threads=None, peak=None, verdict=None):
    return {"rung": rung, "batch_size": 100, "status": "ok",
            "figures": {"samples_per_s": {"median": median, "min": median - spread,
                                          "max": median + spread}, "peak": peak or {}},
            "settings": {"cpu_threads": threads}, "env": {"cpu": {"physical_cores": 2}},
            "verdict": verdict or {}, "numerics": {"status": "ok"}}


def test_slower_rungs_threads_and_peaks_under_the_table():
    theory = {"flops_per_s": 1.6e11, "cores": 2, "clock_ghz": 2.5,
              "flops_per_cycle_per_core": 32, "isa": "AVX2+FMA"}
    peak = {"dtype": "fp32", "flops_per_s": 1.2e11, "size": 2048, "theory": theory}
    threads = {"threads": 2, "interop_threads": 1, "pinned_cpus": None}
    records = [_record("plain", 7000, 100, threads, peak), _record("fp32", 7500, 100),
               _record("+fused", 9500, 100),
               _record("+compile", 9000, 100, verdict={"line": "dispatch-bound: ..."}),
               _record("+wide", 9400, 300)]
    assert report.slower_lines(records) == [
        "+compile (bs 100) is slower than +fused (x0.95): dispatch-bound: ..."]
    assert report.threads_label(records) == "2 threads (1 inter-op), one per physical core"
    (line,) = report.peak_lines(records)
    assert "measured 0.12 TFLOP/s" in line and "first principles 0.16 TFLOP/s" in line
    assert "measured 75% of it" in line
    out = io.StringIO()
    report.print_ladder(records, title="t", file=out)
    assert "slower than the rung above:" in out.getvalue()
    assert "2 threads (1 inter-op)" in out.getvalue()


def test_a_fed_rung_slower_than_synthetic_says_what_feeding_costs():
    # The profiled windows of ResNet-50's top rung at bs 512 on an H200, synthetic and fed by
    # gpu-jpeg from 8,192 JPEGs (2026-11-29; the nvJPEG colour conversion now its own class).
    above = _record("+wgrad-stream", 8326, 4,
                    verdict={"line": "device-bound (memory-bound): ... norm/element-wise"})
    above["figures"]["profile"] = {"step_ms": 61.50, "busy_pct": 99.24, "idle_data_pct": 0.0,
                                   "by_class_ms": {"matmul/conv": 27.92}, "h2d_ms": 0.0}
    fed = _record("+loader", 7612, 500,
                  verdict={"line": "device-bound (memory-bound): ... norm/element-wise"})
    fed["data"] = {"loader": "gpu-jpeg", "root": "/tmp/jpeg"}
    fed["figures"]["profile"] = {"step_ms": 67.28, "busy_pct": 92.31, "idle_data_pct": 1.01,
                                 "by_class_ms": {"matmul/conv": 27.89, "input": 5.75},
                                 "h2d_ms": 4.31, "h2d_pageable": True}
    (line,) = report.slower_lines([above, fed])
    assert line.startswith("+loader (bs 100) is slower than +wgrad-stream (x0.91): feeding, "
                           "not the model (gpu-jpeg): the step takes 67.3 ms against 61.5 ms")
    assert "the GPU idles 8% of it (against 1%), 1% of it waiting for batches" in line
    assert "the loader's kernels (decoding, crops) take 5.75 ms of the GPU" in line
    assert "host-to-device copies 4.31 ms per step from pageable memory" in line
    assert "norm/element-wise" not in line  # the model's verdict, the rung above's too
    # Without both profiles' figures: the verdict, as for any rung.
    del above["figures"]["profile"]["busy_pct"]
    (line,) = report.slower_lines([above, fed])
    assert line.endswith("device-bound (memory-bound): ... norm/element-wise")
    del above["figures"]["profile"]
    (line,) = report.slower_lines([above, fed])
    assert line.endswith("device-bound (memory-bound): ... norm/element-wise")


def test_the_first_principles_peak_and_its_assumptions_are_said_once():
    theory = {"flops_per_s": 1.6e11, "cores": 2, "clock_ghz": 2.5,
              "flops_per_cycle_per_core": 32, "isa": "AVX2+FMA",
              "assumptions": "two FMA units; the clock as the hypervisor shows it, boost higher"}
    peak = {"dtype": "fp32", "flops_per_s": 1.2e11, "size": 2048, "theory": theory}
    out = io.StringIO()
    report.print_ladder([_record("plain", 7000, 100, peak=peak)], title="t", file=out)
    text = out.getvalue()
    assert text.count("first principles") == 1 and text.count("hypervisor") == 1, text


def test_threads_default_to_physical_cores():
    assert default_threads() >= 1
    before = torch.get_num_threads()
    try:
        got = apply_cpu_threads(1, pin=False)
        assert got["threads"] == 1 and got["pinned_cpus"] is None
        assert got["interop_threads"] == torch.get_num_interop_threads()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match=">= 1"):
        apply_cpu_threads(1, interop_threads=0)


def test_pinning_takes_one_cpu_per_core(tmp_path, monkeypatch):
    from kasoku.accel import cpu_threads
    monkeypatch.setattr(cpu_threads, "core_cpus", lambda root, affinity: [0, 1, 2, 3])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(list(cpus)))
    assert cpu_threads._pin_to_cores(4) == [0, 1, 2, 3] and pinned == [[0, 1, 2, 3]]
    assert cpu_threads._pin_to_cores(6) is None  # more threads than cores: asked for
    assert PLAIN.skip is None


def test_keep_memory_sets_glibc_malloc_in_a_process_of_its_own(tmp_path):
    import subprocess
    import sys

    from kasoku.accel.host_memory import apply_keep_memory
    notes: list[str] = []
    assert apply_keep_memory("meta", notes) is False and "not meta's" in notes[0]
    code = ("from kasoku.accel.host_memory import apply_keep_memory; "
            "print(apply_keep_memory('cpu', []))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    import platform
    assert out == str(platform.libc_ver()[0] == "glibc")
    rungs, notes = resolve([r for r in cpu_ladder(AMX) if r.label == "+keep-memory"], "cuda",
                           has_conv=False)
    assert not rungs[0].config.keep_memory and "keep_memory does not apply" in notes[0]
