"""K-FAC's cost as phases of its own (kfac_factors, kfac_inverse, kfac_precondition): the marks
of real training steps and their hand-backs, an unchanged loss when nobody times, sampling
that does not alias with K-FAC's schedule, and ``kasoku profile --optimizer kfac`` end to
end. The kfac-bound verdict: tests/test_profile_verdict.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kasoku.cli import main
from kasoku.commands.train import build_trainer
from kasoku.core import phases as phases_mod
from kasoku.core.phases import PHASES, NoClock, PhaseClock, no_mark
from kasoku.data.config import DataConfig
from kasoku.kfac import KFACConfig
from kasoku.kfac.phases import PHASES as KFAC_PHASES
from kasoku.perf.profile import trace
from kasoku.perf.profile.timeline import PHASE_COLORS
from kasoku.train.config import TrainConfig
from kasoku.workloads import create_workload

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")

FACTOR_EVERY, INVERSE_EVERY = 2, 4
SRC = Path(__file__).resolve().parents[1] / "src"


def kfac_trainer(tmp_path, name="run"):
    return build_trainer(create_workload("cifar10-lenet5"),
                         DataConfig(synthetic=True, synthetic_train_size=200),
                         TrainConfig(batch_size=20, lr=0.01, optimizer="kfac",
                                     out=tmp_path / name, progress=False),
                         kfac=KFACConfig(factor_update_freq=FACTOR_EVERY,
                                         inv_update_freq=INVERSE_EVERY))


class Recording:
    """A phase clock that also keeps the sequence of its marks."""

    def __init__(self, inner):
        self.inner, self.marks = inner, []

    def mark(self, phase):
        self.marks.append(phase)
        return self.inner.mark(phase)

    def step(self):
        self.inner.step()

    def take(self):
        return self.inner.take()


def expected_marks(layers: int, factor: bool, inverse: bool) -> list[str]:
    """Each K-FAC mark hands back to the phase it interrupted."""
    nested = lambda phase: [phase] + ["kfac_factors", phase] * (layers if factor else 0)
    return (["data", "h2d", *nested("forward"), *nested("backward"), "update"]
            + ["kfac_factors"] * factor + ["kfac_inverse"] * inverse
            + ["kfac_precondition", "update", "other"])


def test_kfac_phases_on_their_steps_only_and_handed_back(tmp_path):
    trainer = kfac_trainer(tmp_path)
    u = trainer.updater
    layers = len(u.optimizer.preconditioner.layers)
    assert u.optimizer.mark is no_mark  # nothing is timed until the Updater gives a clock
    for _ in range(2 * INVERSE_EVERY):
        t = u.optimizer.preconditioner.steps
        factor, inverse = t % FACTOR_EVERY == 0, t % INVERSE_EVERY == 0
        u.phases = clock = Recording(PhaseClock("cpu"))
        u.update()
        clock.step()
        times = clock.take()
        assert clock.marks == expected_marks(layers, factor, inverse), t
        assert ("time/kfac_factors" in times) == factor
        assert ("time/kfac_inverse" in times) == inverse
        assert times["time/kfac_precondition"] > 0
        for phase in ("forward", "backward", "update"):
            assert times[f"time/{phase}"] > 0
        parts = [times[f"time/{p}"] for p in PHASES if f"time/{p}" in times]
        assert sum(parts) == pytest.approx(times["time/step"], rel=1e-9)
        assert u.optimizer.mark == clock.mark  # the optimizer takes the step's clock


def test_timing_kfac_leaves_the_training_unchanged(tmp_path):
    timed, untimed = kfac_trainer(tmp_path, "timed"), kfac_trainer(tmp_path, "untimed")
    untimed.updater.phases = NoClock()
    for _ in range(INVERSE_EVERY + 1):
        timed.updater.update()
        untimed.updater.update()
    assert timed.updater.phases.take()["time/kfac_inverse"] > 0
    for a, b in zip(timed.model.parameters(), untimed.model.parameters()):
        assert torch.equal(a, b)


class FakeTime:
    """``time`` for the phase clock: ``perf_counter`` reads ``now``, which the test moves."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def run_schedule(clock, clock_time, steps, step_s=1e-3, factor=(10, 0.01),
                 inverse=(50, 0.1)) -> dict:
    """Drive ``clock`` through ``steps`` steps of a K-FAC-like schedule: a plain step of
    ``step_s`` seconds, plus ``factor = (every, seconds)`` and ``inverse`` likewise."""
    for t in range(steps):
        clock.step()
        clock.mark("data")
        clock.mark("forward")
        clock_time.now += step_s
        for phase, (every, seconds) in (("kfac_factors", factor), ("kfac_inverse", inverse)):
            if t % every == 0:
                was = clock.mark(phase)
                clock_time.now += seconds
                if was is not None:
                    clock.mark(was)
        clock.mark("update")
    clock.step()
    timed = clock.steps
    return {**clock.take(), "timed_steps": timed}


def test_sampled_steps_do_not_alias_with_the_kfac_schedule(monkeypatch):
    """One step in 8 timed, factor steps every 10, inverse steps every 50: a fixed stride of 8
    lands on a factor step 1 time in 5 and an inverse step 1 in 25, twice their rates; the
    clock's random draw gives each step the same chance, so its means are the run's."""
    assert sum(t % 10 == 0 for t in range(0, 32000, 8)) / 4000 == 2 * (1 / 10)
    assert sum(t % 50 == 0 for t in range(0, 32000, 8)) / 4000 == 2 * (1 / 50)
    clock_time = FakeTime()
    monkeypatch.setattr(phases_mod, "time", clock_time)
    clock = PhaseClock("cpu", sample_every=8, sample_period_s=0.0)
    times = run_schedule(clock, clock_time, 32000)
    assert times["time/kfac_factors"] == pytest.approx(1e3 * 0.01 / 10, rel=0.1)
    assert times["time/kfac_inverse"] == pytest.approx(1e3 * 0.1 / 50, rel=0.25)
    assert times["time/forward"] == pytest.approx(1.0)
    assert times["timed_steps"] == pytest.approx(32000 / 8, rel=0.05)


def test_the_time_cap_does_not_favour_the_steps_after_a_long_one(monkeypatch):
    """Plain steps of 1 ms, inverse steps of 41 ms every 10: at most about one timed step per
    20 ms. A gate that waits 20 ms after each timed step would time mostly the step after an
    inverse step; the rate set from the mean step time times each step alike."""
    clock_time = FakeTime()
    monkeypatch.setattr(phases_mod, "time", clock_time)
    clock = PhaseClock("cpu", sample_every=2, sample_period_s=0.02)
    steps = 40000
    times = run_schedule(clock, clock_time, steps, factor=(1, 0.0), inverse=(10, 0.04))
    assert times["time/kfac_inverse"] == pytest.approx(1e3 * 0.04 / 10, rel=0.1)
    assert times["timed_steps"] == pytest.approx(clock_time.now / 0.02, rel=0.15)


def test_kfac_declares_its_phases_to_a_clock_that_knows_none():
    """The phase clock (the ground layer) lists K-FAC's phases once K-FAC's optimizer is
    imported (it declares them), after ``update``, in the order they always had; before, it
    names none."""
    code = ("import kasoku.core.phases as p; before = tuple(p.PHASES); "
            "import kasoku.kfac.optimizer; print(before); print(tuple(p.PHASES))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.splitlines()
    assert before == str(("data", "h2d", "forward", "backward", "update", "allreduce",
                          "compute", "other"))
    assert after == str(("data", "h2d", "forward", "backward", "update", "kfac_factors",
                         "kfac_inverse", "kfac_precondition", "allreduce", "compute", "other"))
    assert KFAC_PHASES == ("kfac_factors", "kfac_inverse", "kfac_precondition")
    with pytest.raises(ValueError, match="one of the step's own"):
        phases_mod.declare_phases(["update"])


def test_every_phase_has_a_colour_and_kfac_phases_are_listed():
    assert set(KFAC_PHASES) < set(PHASES) and set(PHASE_COLORS) == set(PHASES)
    assert no_mark("kfac_factors") is None and NoClock().mark("forward") is None


def test_profile_measures_whole_cycles_with_every_step_timed(tmp_path):
    from kasoku.commands.profile import ProfileConfig
    from kasoku.commands.profile_steps import time_steps
    u = kfac_trainer(tmp_path).updater
    sampled = u.phases = PhaseClock("cpu", sample_every=10**6)  # times nothing, nearly
    result = time_steps(u, ProfileConfig(skip=1, measure_steps=3))
    assert result["measured_steps"] == INVERSE_EVERY and result["cycle_steps"] == INVERSE_EVERY
    assert set(f"time/{p}" for p in KFAC_PHASES) <= set(result["phases"])
    assert u.phases is sampled


def test_kasoku_profile_reports_kfac_phases_and_verdict(tmp_path, capsys):
    out = tmp_path / "prof"
    code = main(["profile", "cifar10-lenet5", "--synthetic", "--synthetic-size", "200",
                 "--device", "cpu", "--batch-size", "20", "--lr", "0.01",
                 "--optimizer", "kfac", "--kfac-factor-update-freq", str(FACTOR_EVERY),
                 "--kfac-inv-update-freq", str(INVERSE_EVERY), "--skip", "1",
                 "--measure-steps", "5", "--steps", "2", "--warmup", "1", "--out", str(out),
                 "--estimate"])
    assert code == 0
    text = capsys.readouterr().out
    result = json.loads((out / "profile.json").read_text())
    assert result["measured_steps"] == 2 * INVERSE_EVERY  # 5 rounded up to whole cycles
    phases, f = result["phases"], result["figures"]
    assert all(f"time/{p}" in phases for p in KFAC_PHASES)
    assert f["kfac_pct"] == pytest.approx(sum(phases[f"time/{p}%"] for p in KFAC_PHASES))
    k = f["kfac"]
    assert k["inv_update_freq"] == INVERSE_EVERY and k["steps"] == 2 * INVERSE_EVERY
    assert k["without_ms"] == pytest.approx(phases["time/step"] - k["ms_per_step"])
    assert "kfac_inverse" in text and "K-FAC: " in text
    # K-FAC's work is most of a LeNet-5 step on a CPU (72% with these settings when this
    # was written, on a 2-core EPYC), far above the rule's 25%.
    assert result["verdict"]["rule"] == "kfac-bound"
    assert "K-FAC's curvature work is" in result["verdict"]["reason"]
    assert result["verdict"]["lever"]["args"][0] in ("--kfac-inv-update-freq",
                                                     "--kfac-factor-update-freq",
                                                     "--kfac-method")
    assert 'id="kfac"' in (out / "report.html").read_text()
    spans = {trace.phase_name(s) for s in trace.load(out / "trace.json").phases}
    assert {"forward", "kfac_factors", "kfac_precondition"} <= spans


def test_time_next_times_the_next_step_whatever_the_draw():
    clock = PhaseClock("cpu", sample_every=10**6)  # almost never timed by the draw
    clock.step()
    clock.time_next()
    clock.step()  # the step that begins now is timed
    clock.mark("data")
    clock.mark("forward")
    clock.step()
    assert clock.steps == 1 and "time/forward" in clock.take()
