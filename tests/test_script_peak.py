"""Advice that always says what to expect (``kasoku.advisor.levers``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_profile_verdict import Builder, cpu_step, figures

from kasoku.advisor.saved import judge_saved


def test_a_balanced_step_names_where_to_start():
    # Busy 60%, no rule's thresholds met (tests/test_profile_verdict_cpu.py's balanced step).
    def body(b, t0):
        b.phase("data", t0, 10)
        b.phase("forward", t0 + 10, 990)
        b.sync(t0 + 20, 900)
        for i in range(6):
            b.kernel(b.launch(t0 - 900 + i), "sm90_xmma_gemm", t0 + 20 + 160 * i, 100)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={})
    v = judge_saved(f)
    assert v.rule == "balanced"
    assert v.lever.text == (f"no single bottleneck to remove; start from the largest share, "
                            f"conv/matmul: 100% of the kernel time "
                            f"({f['by_kind_ms']['conv/matmul']:.2f} ms per step; the "
                            f"report's top kernels name them)")
    assert v.line.endswith("(no estimate: no one bound)")
    # a CPU step of products with no peak measured: the operators' largest share
    cpu = judge_saved(figures(Builder().steps(4, 1000, cpu_step()), device="cpu",
                              config={"precision": "fp32"}))
    assert cpu.rule == "balanced" and "conv/matmul: " in cpu.lever.text


@pytest.mark.parametrize("name", sorted(p.stem for p in (
    Path(__file__).parent / "fixtures" / "verdicts").glob("*.json")))
def test_no_advice_expects_unknown(name):
    f = json.loads((Path(__file__).parent / "fixtures" / "verdicts" / f"{name}.json")
                   .read_text())["figures"]
    for variant in (f, {**f, "peak_fraction": None, "config": {}, "threads": 4}):
        v = judge_saved(variant)
        levers = [v.lever, *v.candidates, *([v.fallback] if v.fallback else [])]
        assert all("unknown" not in lever.expect for lever in levers), v.line
        assert not v.line.endswith("(unknown)")
