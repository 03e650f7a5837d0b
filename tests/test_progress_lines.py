"""Progress on the long waits: the lever tries say why they stopped before their last round,
and a script's profile says when its window has ended and the script runs on."""
from __future__ import annotations

from kasoku.advisor.levers import Lever
from kasoku.commands import ab
from kasoku.commands.script_profile import runs_on_line
from kasoku.train.extensions.progress_bar import epoch_text


def _side(extra) -> dict:
    return {"samples_per_s": 100.0 if not extra else 120.0, "window_rates": [100.0],
            "phases": {}}


def test_the_tries_say_the_budget_stopped_them():
    lever = Lever("--compile", "estimate ~1.3x", {"accel.compile": True})
    lines: list[str] = []
    outcomes = ab.try_levers([], [lever], say=lines.append, rounds=3, budget_s=0.0,
                             measure=_side)
    assert len(outcomes[0].rates) == 1
    assert lines[0] == "  --compile (round 1 of 3) ..."
    assert lines[1].startswith("  stopped after round 1 of 3: the 0 s budget for the tries (")
    assert len(lines) == 2
    lines.clear()  # every round fits: nothing more said
    ab.try_levers([], [lever], say=lines.append, rounds=2, budget_s=1e9, measure=_side)
    assert [ln for ln in lines if "stopped" in ln] == []
    assert ab.budget_line(1, 3, 60.0, 41.4) == (
        "  stopped after round 1 of 3: the 60 s budget for the tries (41 s so far; another "
        "round would pass it; fewer rounds make the figures noisier)")


def test_a_script_running_on_after_its_window_is_told_so():
    line = runs_on_line(44)
    assert line.startswith("the profile's window ended at step 44; the script runs on to its "
                           "end, then the verdict")
    assert "--stop-after-window" in line and "Ctrl-C" in line


def test_the_epoch_has_the_digits_one_iteration_moves():
    assert epoch_text(0.0, 0) == "0.00"
    assert epoch_text(3.0, 30) == "3.00"  # ten iterations an epoch: two decimals, as before
    assert epoch_text(22 / 7686, 22) == "0.0029"  # gpt's: thousands of iterations an epoch
    assert epoch_text(23 / 7686, 23) != epoch_text(22 / 7686, 22)
    assert epoch_text(1e-9, 1) == "0.000000"  # six at most
