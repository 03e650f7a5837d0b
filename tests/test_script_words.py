"""A script's advice is in the script's terms (``kasoku.advisor.script_words``): every lever
said to a script is a ``--with`` lever kasoku sets from outside or an edit at the script's
line, never a flag of kasoku's own workloads; a batch kasoku did not see come from a
DataLoader is no number of samples; and timed steps that were unstable are said on the
terminal beside the advice."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kasoku.accel.config import AccelConfig
from kasoku.advisor.saved import judge_saved
from kasoku.advisor.script import ScriptVerdict
from kasoku.advisor.script_words import workload_flags
from kasoku.advisor.verdict import judge
from kasoku.commands.profile import ProfileConfig
from kasoku.commands.script_ab import advise_script
from kasoku.commands.script_levers import ScriptFacts
from kasoku.commands.script_profile import unstable_line, verdict_lines
from kasoku.perf.profile.figures import StepFigures

FIXTURES = Path(__file__).parent / "fixtures" / "verdicts"
CPU_RULES = {"latency-bound", "compute-bound", "memory-bound", "kfac-bound",
             "communication-bound", "dispatch-bound"}
"""The rules the CPU fixtures reach (tests/test_verdict_corpus.py)."""

NO_LOADER = ScriptFacts(forward_site="train.py:30")
"""A script that makes its own batches (a word language model slicing its tensors, a policy's
episode per step): no DataLoader seen."""
LOADER = ScriptFacts(loader_site="train.py:12", forward_site="train.py:30", num_workers=0,
                     has_conv=True, loader_steps=True, batch_size=64)
STABLE = {"stable": True, "reasons": []}


class EvenSides:
    """A/B sides that all run at the same rate: nothing is faster, so the advice falls back
    (the edits, then the rule's word)."""

    def measure(self, extra=()):
        return {"samples_per_s": 100.0, "window_rates": [100.0, 100.0, 100.0], "phases": {}}

    def text(self, extra=()):
        return "kasoku profile -- python train.py"


def scripts_lines(figures: dict, judged, facts: ScriptFacts, cfg: ProfileConfig,
                  stability: dict = STABLE) -> tuple[ScriptVerdict, list[str]]:
    """The terminal's lines for a script judged ``judged`` and advised with ``cfg``, and every
    text of the saved verdict a person reads (its lever, edits, fallback, unconfirmed)."""
    f = StepFigures.from_dict(figures)
    result = {"device": "cuda:0" if f.device == "cuda" else "cpu", "figures": f,
              "verdict": ScriptVerdict(judged), "out": "runs/x", "report": "runs/x/report.html",
              "stability": stability}
    verdict = advise_script(result, facts, EvenSides(), cfg, say=lambda line: None)
    saved = verdict.to_dict()
    texts = [saved["line"], saved["lever"]["text"], saved["lever"]["caveat"],
             *(e["text"] for e in saved.get("edits") or []),
             *(saved.get("unconfirmed") or []),
             *([saved["fallback"]["text"]] if saved.get("fallback") else [])]
    return verdict, verdict_lines(result) + texts


def test_the_scan_finds_a_workload_flag_and_passes_a_scripts_own():
    assert workload_flags("more loader workers (--loader KIND:N), or --batch-size 200") == [
        "--loader", "--batch-size"]
    assert workload_flags("kasoku profile --with workers=4 --estimate -- python train.py") == []
    assert workload_flags("torch.compile the model, torch.backends.cudnn.benchmark") == []


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_no_advice_to_a_script_names_a_workload_flag(name):
    """Each fixture's figures judged as a script's (with the script's own settings, and with
    the workload's as saved), advised as an estimate, measured with nothing faster, and
    confirmed; with and without a DataLoader."""
    figures = json.loads((FIXTURES / f"{name}.json").read_text())["figures"]
    precision = (figures.get("config") or {}).get("precision", "fp32")
    script = judge(StepFigures.from_dict(figures), AccelConfig(precision=precision))
    for judged in (script, judge_saved(figures)):
        for facts in (NO_LOADER, LOADER):
            for cfg in (ProfileConfig(estimate=True), ProfileConfig(confirm=True, rounds=1)):
                _, lines = scripts_lines(figures, judged, facts, cfg)
                named = {line: workload_flags(line) for line in lines if workload_flags(line)}
                assert not named, (judged.rule, facts, cfg)


def test_the_cpu_fixtures_reach_every_cpu_rule():
    """... so the scan above covers each of them."""
    rules = {judge_saved(json.loads(p.read_text())["figures"]).rule
             for p in FIXTURES.glob("cpu-*.json")}
    assert rules == CPU_RULES


def test_a_batch_not_taken_from_a_dataloader_is_no_number_of_samples():
    """sine-lstm at batch 1 (dispatch-bound): its larger batch, said to a script that makes
    its own batches, to one whose DataLoader's batches the steps do not take, and to one whose
    steps take them from a DataLoader of 64."""
    figures = json.loads((FIXTURES / "cpu-epyc2-sine-lstm-bs1.json").read_text())["figures"]
    judged = judge_saved(figures)
    assert judged.rule == "dispatch-bound"
    beside = ScriptFacts(loader_site="train.py:12", forward_site="train.py:30",
                         loader_steps=False, batch_size=64)
    for facts in (NO_LOADER, beside):
        verdict, _ = scripts_lines(figures, judged, facts, ProfileConfig(estimate=True,
                                                                         confirm=True))
        (batch,) = [e for e in verdict.edits if "batch" in e.text]
        assert batch.text.startswith("more work per step: a larger batch where the script "
                                     "makes its batches (its forward: train.py:30)")
        assert "samples" not in batch.text and "2" not in batch.text.split("train.py:30")[0]
        assert "twice" not in batch.caveat
        assert verdict.unconfirmed == ["batch x2"]
    verdict, _ = scripts_lines(figures, judged, LOADER, ProfileConfig(estimate=True,
                                                                      confirm=True))
    (batch,) = [e for e in verdict.edits if "batch" in e.text]
    assert batch.text.startswith("a batch twice as large: DataLoader(..., batch_size=128) at "
                                 "train.py:12")
    assert verdict.unconfirmed == ["batch x2 (128)"]


def test_a_rules_fallback_is_said_in_the_scripts_terms():
    """K-FAC's own lever, and the input-bound rule's word where no lever applies to the
    script: as edits, never as the workload's flags."""
    kfac = json.loads((FIXTURES / "cpu-epyc2-cifar10-lenet5-kfac.json").read_text())["figures"]
    verdict, _ = scripts_lines(kfac, judge_saved(kfac), NO_LOADER,
                               ProfileConfig(estimate=True, confirm=True))
    assert verdict.lever.text.startswith("update K-FAC's factors half as often (every 2 steps)")
    assert verdict.unconfirmed == ["the base optimizer alone"]
    top = json.loads((FIXTURES / "h200-imagenet-resnet50-top.json").read_text())["figures"]
    judged = judge_saved(top)
    assert judged.rule == "input-bound" and "--loader" in judged.fallback.text
    # the workers lever measured and no faster: the advice says so, then the rule's word,
    # which no longer offers more workers (what was just measured) but fewer calls per batch
    verdict, _ = scripts_lines(top, judged, LOADER, ProfileConfig(rounds=1))
    assert verdict.lever.text.startswith("none of the levers tried was faster here")
    assert "workers=" in verdict.lever.text
    assert verdict.lever.text.endswith("; fewer Python calls per batch: a larger batch, or each "
                                       "batch taken from the tensors by one index (the "
                                       "DataLoader's sampler a BatchSampler, batch_size=None) "
                                       "at train.py:12, smaller inputs, or faster storage")
    assert "more DataLoader worker processes" not in verdict.verdict.fallback.text
    # not measured (--estimate): the rule's word offers the workers
    verdict, _ = scripts_lines(top, judged, LOADER, ProfileConfig(estimate=True))
    assert verdict.verdict.fallback.text.startswith("more DataLoader worker processes")


def test_unstable_timed_steps_are_said_beside_the_advice():
    figures = json.loads((FIXTURES / "cpu-epyc2-mnist-mlp.json").read_text())["figures"]
    busy = {"stable": False, "reasons": ["load average 3.1 on 2 cores"]}
    _, lines = scripts_lines(figures, judge_saved(figures), LOADER,
                             ProfileConfig(estimate=True), stability=busy)
    (said,) = [line for line in lines if line.startswith("unstable: ")]
    assert said == unstable_line(busy)
    assert "load average 3.1 on 2 cores" in said and "measure again on a quiet machine" in said
    _, lines = scripts_lines(figures, judge_saved(figures), LOADER,
                             ProfileConfig(estimate=True))
    assert not [line for line in lines if line.startswith("unstable")]
    assert unstable_line(None) is None
