"""A script's CPU step against the measured matmul peak (its products' FLOPs counted from the
window's operators, recorded with their shapes), the cap on a window's trace, and advice that
always says what to expect (``kasoku.commands.script_profile``, ``kasoku.perf.profile.work``,
``kasoku.advisor.levers``)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_profile_script import WINDOW, write
from test_profile_verdict import Builder, cpu_step, figures

from kasoku.advisor.saved import judge_saved
from kasoku.cli import main
from kasoku.commands import profile as profile_cmd
from kasoku.commands.script_profile import too_large_line
from kasoku.perf.peak import PeakResult
from kasoku.perf.profile import window as window_mod
from kasoku.perf.profile.work import product_flops

MLP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
for step in range(1000):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
MLP_FLOPS = 2 * 256 * (
    (1024 * 1024 + 1024 * 1024 + 1024 * 10)  # forward: three products
    + (1024 * 1024 + 1024 * 10) * 2  # backward: the last two layers' input and weight grads
    + 1024 * 1024)  # the first layer's weight grad (its input needs none)
"""A step's matrix-product FLOPs, counted by hand: 2 per multiply-add."""

STEPS = """
import torch
m = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(20):
    m(torch.randn(8, 64)).sum().backward()
    opt.step()
print("ran 20 steps")
"""


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fixed_peak(flops_per_s: float):
    def measure(device, dtype, size=None, reps=None):
        return PeakResult(dtype, "cpu", "test CPU", size or 1024, flops_per_s, flops_per_s,
                          flops_per_s, 1, 1, 1)
    return measure


def test_a_script_of_big_products_gets_its_share_of_the_peak(in_tmp, capsys, monkeypatch):
    # The peak as measured here would be shared with whatever else this machine runs: one
    # no 2-core CPU reaches (10 TFLOP/s) makes the share small, and the rules say so.
    monkeypatch.setattr(profile_cmd, "measure_matmul_peak", fixed_peak(1e13))
    write(in_tmp, "mlp.py", MLP)
    assert main(["profile", *WINDOW, "--stop-after-window", "--out", "prof", "--",
                 "python", "mlp.py"]) == 0
    err = capsys.readouterr().err
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    f = result["figures"]
    assert f["product_flops"] == {"fp32": pytest.approx(MLP_FLOPS, rel=1e-9)}
    assert f["flops_per_step"] == pytest.approx(MLP_FLOPS, rel=1e-9)
    assert f["peak_dtype"] == "fp32" and f["peak_flops_per_s"] == 1e13
    step_s = 1 / result["unprofiled"]["steps_per_s"]
    assert f["peak_fraction"] == pytest.approx(MLP_FLOPS / step_s / 1e13)
    # most of the step in products far from the peak: latency-bound, not balanced
    assert result["verdict"]["rule"] == "latency-bound", result["verdict"]["line"]
    assert "of its measured fp32 peak: too small to keep the cores busy" in err
    assert "unknown" not in result["verdict"]["line"]
    # The same figures nearer the peak are compute-bound.
    near = judge_saved({**f, "peak_fraction": 0.5})
    assert near.rule == "compute-bound" and "50% of its measured fp32 peak" in near.reason


def test_a_window_trace_over_the_cap_is_not_analysed(in_tmp, capsys, monkeypatch):
    monkeypatch.setattr(window_mod, "TRACE_CAP_BYTES", 1000)
    write(in_tmp, "steps.py", STEPS)
    assert main(["profile", *WINDOW, "--out", "prof", "--", "python", "steps.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "ran 20 steps\n"  # the script went on to its end
    size = (in_tmp / "prof" / "trace.json").stat().st_size
    # one line after the window's, no traceback: the size, the steps, what to do, what was
    # kept
    assert err.splitlines()[0].startswith("kasoku: the profile's window ended at step ")
    err = err.split("\n", 1)[1]
    assert err.startswith(f"kasoku: the window's trace is too large to analyse: "
                          f"{size / 1e9:.2f} GB for 4 profiled steps, over the 0 MB kasoku "
                          f"reads; even --steps 1 would record about {size / 2e6:.0f} MB: "
                          f"each step runs too many operators (measured without the "
                          f"profiler: "), err
    assert err.count("\n") == 1 and err.endswith(" steps/s, in measure.json)\n")
    kept = json.loads((in_tmp / "prof" / "measure.json").read_text())
    assert kept["measured_steps"] == 2 and kept["steps_per_s"] > 0
    assert not (in_tmp / "prof" / "profile.json").exists()


@pytest.mark.parametrize(("size", "says"), [
    # the LBFGS: 10 steps, each running its closure 20 times
    (2.17e9, "2.17 GB for 11 profiled steps, over the 300 MB kasoku reads; even --steps 1 "
             "would record about 395 MB: each step runs too many operators"),
    (1.0e9, "1.00 GB for 11 profiled steps, over the 300 MB kasoku reads; profile fewer "
            "steps: --steps 2"),
])
def test_too_large_says_how_many_steps_fit(size, says):
    watch = SimpleNamespace(cfg=SimpleNamespace(steps=10), batch_size=32,
                            measured={"steps_per_s": 4.0, "samples_per_s": 128.0})
    line = too_large_line(watch, int(size))
    assert line.startswith(f"the window's trace is too large to analyse: {says} ")
    assert line.endswith("(measured without the profiler: 250.00 ms per step, 128.0 "
                         "samples/s, in measure.json)")


def op(name, ts, dur, dims, types=("float", "float"), tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1,
            "tid": tid, "args": {"Input Dims": dims, "Input type": list(types)}}


def test_product_flops_counts_each_operator_once_in_its_steps():
    conv = [[8, 3, 32, 32], [16, 3, 3, 3], [16]]
    events = [
        op("aten::addmm", 0, 50, [[64], [32, 128], [128, 64]], ("float",) * 3),  # before
        op("aten::convolution", 100, 50, conv, ("float",) * 3),
        op("aten::_convolution", 105, 40, conv, ("float",) * 3),  # inside: counted once
        op("aten::mm", 160, 10, [[32, 128], [128, 64]], ("c10::BFloat16",) * 2),
        op("aten::mm", 160, 10, [[32, 128], [128, 64]], tid=2),  # another thread's
        op("aten::add_", 180, 5, [[32, 64], [32, 64]]),
    ]
    # padding 0, stride 1: 30 x 30 outputs of 16 x 3 x 3 x 3 multiply-adds per image
    conv_flops = 2.0 * 8 * 16 * 3 * 3 * 3 * 30 * 30
    mm = 2.0 * 32 * 128 * 64
    assert product_flops(events, steps=2, between=(100, 200)) == {
        "fp32": pytest.approx((conv_flops + mm) / 2), "bf16": pytest.approx(mm / 2)}
    assert product_flops(events)["fp32"] == pytest.approx(conv_flops + 2 * mm)


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


def test_a_saved_lever_expecting_unknown_says_nothing_rather_than_unknown():
    from kasoku.advisor.levers import Lever
    from kasoku.advisor.verdict import Verdict
    for said in ("unknown", "estimate: unknown"):
        lever = Lever.from_dict({"text": "see the phases", "expect": said, "args": []})
        assert lever.expect == said  # read back as saved
        line = Verdict("balanced", "no single bottleneck", lever).line
        assert line == "balanced: no single bottleneck -> see the phases"
    assert Verdict("r", "why", Lever("x", "estimate ~1.3x")).line == "r: why -> x (estimate ~1.3x)"
