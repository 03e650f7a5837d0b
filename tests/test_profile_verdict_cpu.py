"""The verdict's CPU rules (compute, latency, memory, dispatch, input), on constructed traces
built as in tests/test_profile_verdict.py: a CPU step is a host span per phase and the
operators inside it."""
from __future__ import annotations

import pytest
from test_profile_verdict import Builder, cpu_step, figures

from kasoku.advisor.saved import judge_saved


def test_cpu_compute_bound_needs_the_products_and_a_share_of_the_peak():
    f = figures(Builder().steps(4, 1000, cpu_step()), device="cpu", config={"precision": "fp32"},
                peak_fraction=0.5)
    assert f["device"] == "cpu" and f["operator_pct"] == pytest.approx(90, abs=1)
    v = judge_saved(f)
    assert v.rule == "compute-bound" and "50% of its measured fp32 peak" in v.reason
    assert [c.args for c in v.candidates] == [("--compile",)]  # no bf16 hardware: no bf16
    amx = judge_saved({**f, "cpu_bf16": True, "cpu_bf16_isa": "AMX-BF16"}).lever
    assert amx.args == ("--precision", "bf16") and "AMX-BF16 units" in amx.text
    in_bf16 = judge_saved({**f, "cpu_bf16": True, "config": {"precision": "bf16", "compile": True}})
    assert in_bf16.lever.args == () and "no cheap lever" in in_bf16.lever.text
    # The same products at 3% of the peak are too small to be the bound (sine-lstm's step).
    small = judge_saved({**f, "peak_fraction": 0.03, "cpu_bf16": True})
    assert small.rule == "latency-bound" and "too small" in small.reason
    assert "--precision" not in [a for c in small.candidates for a in c.args]
    # No peak measured: no claim of compute-bound.
    assert judge_saved({**f, "peak_fraction": None}).rule == "balanced"


def test_cpu_small_operators_are_latency_bound_and_memory_bound_otherwise():
    tiny = figures(Builder().steps(4, 1000, cpu_step(op_us=900, ops=90)), device="cpu",
                   config={}, threads=2, peak_fraction=0.5)
    v = judge_saved(tiny)  # 10 us per operator
    assert v.rule == "latency-bound" and "mean 10 us" in v.reason
    assert [c.args for c in v.candidates] == [("--compile",), ("--threads", "1"),
                                              ("--batch-size", "200")]

    def elementwise(b, t0):
        b.phase("data", t0, 10)
        b.phase("forward", t0 + 10, 990)
        for i in range(9):
            b.op("aten::add_", t0 + 10 + i * 100, 100)
    f = figures(Builder().steps(4, 1000, elementwise), device="cpu", config={"compile": True},
                peak_fraction=0.5)
    v = judge_saved(f)
    assert v.rule == "memory-bound" and [c.args for c in v.candidates] == [("--keep-memory",)]


def test_cpu_verdict_follows_cpu_info(monkeypatch):
    """The context a CPU run's verdict is judged with comes from kasoku.perf.cpuinfo: a CPU
    without bf16 hardware is never told to use bf16."""
    from kasoku.commands.profile import cpu_bf16
    from kasoku.perf import cpuinfo
    f = figures(Builder().steps(4, 1000, cpu_step()), device="cpu", config={"precision": "fp32"})
    f["peak_fraction"] = 0.5
    avx2 = cpuinfo.CpuInfo(flags=("avx2", "fma"))
    monkeypatch.setattr(cpuinfo, "cpu_info", lambda: avx2)
    assert cpu_bf16() == {"cpu_bf16": False, "cpu_bf16_isa": None}
    assert judge_saved({**f, **cpu_bf16()}).lever.args == ("--compile",)
    xeon = cpuinfo.CpuInfo(flags=("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
    monkeypatch.setattr(cpuinfo, "cpu_info", lambda: xeon)
    assert judge_saved({**f, **cpu_bf16()}).lever.args == ("--precision", "bf16")


def test_cpu_dispatch_bound():
    f = figures(Builder().steps(4, 1000, cpu_step(op_us=300, ops=30)), device="cpu", config={})
    v = judge_saved(f)
    assert v.rule == "dispatch-bound" and v.lever.args == ("--compile",)
    assert "30 per step" in v.reason
    assert [c.args for c in v.candidates] == [("--compile",), ("--batch-size", "200")]
    assert judge_saved({**f, "config": {"compile": True}}).lever.args == ("--batch-size", "200")


def test_cpu_input_bound():
    f = figures(Builder().steps(4, 1000, cpu_step(data_us=500, op_us=400)), device="cpu",
                config={}, loader="serial")
    assert judge_saved(f).rule == "input-bound"


def test_balanced_when_no_rule_holds():
    # Busy 60%; the kernels were queued a step ahead (the host is not late), the device idles
    # between them (a dependency): no rule's thresholds are met.
    def body(b, t0):
        b.phase("data", t0, 10)
        b.phase("forward", t0 + 10, 990)
        b.sync(t0 + 20, 900)
        for i in range(6):
            b.kernel(b.launch(t0 - 900 + i), "sm90_xmma_gemm", t0 + 20 + 160 * i, 100)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={})
    assert f["busy_pct"] == pytest.approx(60, abs=3)
    assert f["idle_host_pct"] < 1
    assert f["host_ms"] < f["device_ms"]
    assert judge_saved(f).rule == "balanced"
