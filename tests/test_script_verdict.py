"""A script's verdict is typed from ``judge`` until ``profile.json`` holds it
(``kasoku.advisor.script.ScriptVerdict``): ``advise_script`` returns it with the script's own
fields set, its ``to_dict`` is the saved verdict's keys in their order, and ``from_dict``
reads a saved one back as it was (the A/B runs of a script under torchrun are made from the
process that launched it, from worker 0's ``profile.json``)."""
from __future__ import annotations

import json
from pathlib import Path

from kasoku.advisor.levers import Lever
from kasoku.advisor.saved import judge_saved
from kasoku.advisor.script import ScriptVerdict
from kasoku.commands.profile import ProfileConfig, write_outputs
from kasoku.commands.script_ab import advise_script, saved_result
from kasoku.commands.script_levers import ScriptFacts
from kasoku.perf.profile.figures import StepFigures

FIXTURE = Path(__file__).parent / "fixtures" / "verdicts" / "h200-mnist-mlp.json"
JUDGED = ["rule", "reason", "line", "lever", "candidates", "tried", "experiments", "secondary",
          "fallback"]


class NoSides:
    """A/B sides that must not run: nothing here is measured."""

    def measure(self, extra=()):
        raise AssertionError(f"a side was run: {extra}")

    def text(self, extra=()):
        return "kasoku profile -- python train.py"


def advised(confirm: bool) -> tuple[dict, ScriptVerdict]:
    figures = json.loads(FIXTURE.read_text())["figures"]
    result = {"device": "cuda:0", "figures": StepFigures.from_dict(figures),
              "verdict": ScriptVerdict(judge_saved(figures))}
    facts = ScriptFacts(forward_site="train.py:30", loader_steps=False)
    verdict = advise_script(result, facts, NoSides(), ProfileConfig(estimate=True,
                                                                    confirm=confirm),
                            say=lambda line: None)
    return result, verdict


def test_advise_script_returns_the_typed_verdict_with_its_fields_set():
    result, verdict = advised(confirm=True)
    assert result["verdict"] is verdict and isinstance(verdict, ScriptVerdict)
    assert verdict.rule == "host-bound" and verdict.measured is False
    # on the GPU, host-bound's CUDA graph is a lever kasoku sets from outside the script
    # (compile=reduce-overhead): the advice, an estimate (--estimate: not measured); the
    # others need an edit
    assert dict(verdict.lever.change) == {"with.compile": "reduce-overhead"}
    assert verdict.lever.expect.startswith("estimate")
    assert verdict.edits and all(isinstance(e, Lever) and not e.change for e in verdict.edits)
    assert verdict.line.endswith(f"-> {verdict.lever.text} ({verdict.lever.expect})")
    assert verdict.unconfirmed == ["batch x2"]  # its batch size unknown: not "(200)"
    assert result["ladder"] == []
    assert list(verdict.to_dict()) == [*JUDGED, "edits", "measured", "unconfirmed"]
    assert verdict.to_dict()["edits"][0] == {"text": verdict.edits[0].text,
                                             "expect": verdict.edits[0].expect}
    _, estimate = advised(confirm=False)
    assert estimate.unconfirmed is None and "unconfirmed" not in estimate.to_dict()


def test_a_script_verdict_round_trips():
    judged = ScriptVerdict(judge_saved(json.loads(FIXTURE.read_text())["figures"]))
    assert list(judged.to_dict()) == JUDGED  # before the advice: the judge's keys alone
    _, verdict = advised(confirm=True)
    for v in (judged, verdict):
        d = v.to_dict()
        assert ScriptVerdict.from_dict(d).to_dict() == d
        saved = json.loads(json.dumps(d))
        assert ScriptVerdict.from_dict(saved).to_dict() == saved


def test_a_script_profile_is_written_as_saved_and_read_back_typed(tmp_path):
    result, verdict = advised(confirm=True)
    result.update(workload="train.py", out=str(tmp_path), settings={})
    figures = result.pop("figures")  # no trace here: profile.json alone
    write_outputs(tmp_path, result)
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["verdict"] == verdict.to_dict()
    (tmp_path / "profile.json").write_text(json.dumps({**saved,
                                                       "figures": figures.to_dict()}))
    back = saved_result(tmp_path / "profile.json")
    assert isinstance(back["verdict"], ScriptVerdict)
    assert back["verdict"].to_dict() == verdict.to_dict()
    assert isinstance(back["figures"], StepFigures)
    assert back["figures"].to_dict() == figures.to_dict()
