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
}


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
    for name in EXPECTED:
        lever = json.loads((FIXTURES / f"{name}.json").read_text())["verdict"]["lever"]
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
