"""The verdict corpus: the figures of real profiles (``tests/fixtures/verdicts``: the
``profile.json`` kasoku wrote, on the 2-core EPYC here and on one H200 through
``benchmarks/verdict_accuracy.py``) with the verdict and the candidate levers each must give.
A change of a rule that flips one fails here; if the change is meant, the table says the new
verdict and the commit says why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kasoku.advisor.saved import judge_saved
from kasoku.perf.profile.figures import TYPED, StepFigures

FIXTURES = Path(__file__).parent / "fixtures" / "verdicts"

COMPILE, BATCH = ("--compile",), ("--batch-size", "200")
DEVICE, PROCESSES = ("--loader", "device"), ("--loader", "multiprocess")
EXPECTED = {
    # 2-core AMD EPYC (AVX512-BF16), torch 2.13: sine-lstm's products at 3% of the peak are
    # small operators, not compute; the MNIST MLP's at 53% are.
    "cpu-epyc2-sine-lstm": ("latency-bound", [COMPILE, BATCH]),
    "cpu-epyc2-cifar10-lenet5": ("latency-bound", [COMPILE, ("--threads", "1"), BATCH]),
    "cpu-epyc2-mnist-mlp": ("compute-bound", [("--precision", "bf16"), COMPILE]),
    "cpu-epyc2-stripes_cnn": ("memory-bound", [COMPILE, ("--channels-last",),
                                               ("--keep-memory",)]),
    # ... LeNet-5 with K-FAC's factors every step, the MNIST MLP on 2 gloo workers, and
    # sine-lstm at batch 1 (most of its step outside operators).
    "cpu-epyc2-cifar10-lenet5-kfac": ("kfac-bound", [("--kfac-factor-update-freq", "2")]),
    "cpu-epyc2-mnist-mlp-2procs": ("communication-bound", [BATCH]),
    "cpu-epyc2-sine-lstm-bs1": ("dispatch-bound", [COMPILE, ("--batch-size", "2")]),
    # One H200, torch 2.11: the recipes as given, then with the step as a CUDA graph.
    "h200-mnist-mlp": ("host-bound", [("--cuda-graph",), COMPILE, BATCH]),
    "h200-sine-lstm": ("host-bound", [("--cuda-graph",), COMPILE, BATCH]),
    "h200-cifar10-lenet5": ("host-bound", [("--cuda-graph",), COMPILE, BATCH]),
    "h200-cifar10-resnet152": ("device-bound (compute-bound)",
                               [("--precision", "bf16"), ("--channels-last",)]),
    "h200-imagenet-resnet50": ("input-bound", [PROCESSES]),
    "h200-mnist-mlp-top": ("input-bound", [DEVICE, PROCESSES]),
    "h200-sine-lstm-top": ("input-bound", [DEVICE, PROCESSES]),
    "h200-cifar10-lenet5-top": ("input-bound", [DEVICE, PROCESSES]),
    # ResNet-50's top rung (bf16, channels_last, cuDNN autotune, fused AdamW, CUDA graph) with
    # 224-pixel synthetic images drawn on the host: the GPU waits 84% of the step.
    "h200-imagenet-resnet50-top": ("input-bound", [PROCESSES]),
    # Each kernel class against its measured limit (one H200, torch 2.11, benchmarks/
    # roofline.py): GPT-2 small's top rung, attention 3.0 ms above its limit, the one kernel
    # kasoku can set for it (flash; cuDNN's ran) measured and no faster; ResNet-50's top rung
    # with its synthetic images on the device, 11 ms of the element-wise kernels above the copy
    # bandwidth, every lever for them set already; nanoGPT's bench.py under kasoku profile.
    "h200-gpt-small-top-roofline": ("device-bound (compute-bound)",
                                    [("--sdpa-backend", "flash")]),
    "h200-imagenet-resnet50-top-device": ("device-bound (memory-bound)", []),
    "h200-nanogpt-bench-script": ("device-bound (compute-bound)", []),
}
ESTIMATED = {"h200-imagenet-resnet50-top-device", "h200-nanogpt-bench-script"}
"""Profiled with --estimate (no lever to measure, or a script's own edits): their advice an
estimate, as saved."""


def test_every_fixture_has_its_expected_verdict():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_corpus_keeps_its_verdicts(name):
    recorded = json.loads((FIXTURES / f"{name}.json").read_text())
    rule, candidates = EXPECTED[name]
    verdict = judge_saved(recorded["figures"])
    assert verdict.rule == rule, verdict.line
    assert [c.args for c in verdict.candidates] == candidates
    assert all(c.expect.startswith("estimate") for c in verdict.candidates)  # not measured
    # ... and the profile that recorded it said the same.
    assert recorded["verdict"]["rule"] == rule


def test_the_recorded_advice_was_measured_and_never_slower():
    """... except where the profile said it was an estimate (``ESTIMATED``)."""
    for name in EXPECTED:
        lever = json.loads((FIXTURES / f"{name}.json").read_text())["verdict"]["lever"]
        if name in ESTIMATED:
            assert lever.get("measured") is None, name
            continue
        measured = lever.get("measured") or {}
        assert measured.get("result") in ("faster", "none faster"), (name, lever)
        if measured["result"] == "faster":
            assert measured["ratio"] >= 1 + measured["noise"], (name, measured)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_saved_figures_read_back_as_saved(name):
    """``StepFigures`` holds a saved profile's figures whole: ``to_dict`` writes them back key
    for key, value for value and in their order, as profile.json held them."""
    figures = json.loads((FIXTURES / f"{name}.json").read_text())["figures"]
    typed = StepFigures.from_dict(figures)
    assert json.dumps(typed.to_dict()) == json.dumps(figures)
    assert typed.device in ("cpu", "cuda") and typed.data_pct == figures["data_pct"]
    assert "config" in typed.rest and "config" not in TYPED  # saved, never read by a rule


def test_restated_figures_keep_their_place_and_the_profiled_ones():
    figures = StepFigures.from_dict(
        json.loads((FIXTURES / "h200-mnist-mlp.json").read_text())["figures"])
    before = {k: v for k, v in figures.to_dict().items() if k != "profiled"}
    again = StepFigures.from_dict(before).restated(100, 100 / 2e-3, 30.0)
    assert list(again.to_dict()) == [*before, "profiled"]
    assert again.step_ms == pytest.approx(2.0) and again.data_pct == 30.0
    assert again.profiled["busy_pct"] == before["busy_pct"]
    assert again.busy_pct == pytest.approx(min(100.0, 100 * before["device_ms"] / 2.0))
    assert again.busy_pct + again.idle_data_pct + again.idle_host_pct \
        + again.idle_other_pct == pytest.approx(100.0)


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if "roofline" in n or n in ESTIMATED))
def test_the_kernel_classes_add_up_to_the_step(name):
    """A GPU profile's classes, the time two streams ran at once and the idle rest add up to
    the step within 5%; the class with most to gain is the one the verdict names."""
    from kasoku.perf.profile.roofline import largest_gap, table_rows
    f = json.loads((FIXTURES / f"{name}.json").read_text())["figures"]
    rows = table_rows(f["roofline"], f["step_ms"])
    assert sum(float(r[1]) for r in rows) == pytest.approx(f["step_ms"], rel=0.05)
    assert largest_gap(f["roofline"])["class"] in judge_saved(f).reason
