"""A saved profile judged again: ``profile.json``'s ``figures`` (``StepFigures.to_dict``), whose
``config`` is the run's ``AccelConfig`` as saved (``dataclasses.asdict``; older profiles lack
the fields added since, a bench rung's adds ``kind``), read back into the typed objects the
rules read. The verdict corpus (tests/fixtures/verdicts) is judged through here."""
from __future__ import annotations

from dataclasses import fields

from kasoku.accel.config import AccelConfig
from kasoku.advisor.verdict import Verdict, judge
from kasoku.perf.profile.figures import StepFigures


def saved_accel(config: dict | None) -> AccelConfig:
    """The ``AccelConfig`` a saved ``config`` describes: its fields as saved, the defaults for
    those it lacks; keys that are no field of it (a bench rung's ``kind``) left out."""
    names = {f.name for f in fields(AccelConfig)}
    return AccelConfig(**{k: v for k, v in (config or {}).items() if k in names})


def judge_saved(figures: dict) -> Verdict:
    """The verdict of a saved profile's ``figures``, judged as when it was measured."""
    return judge(StepFigures.from_dict(figures), saved_accel(figures.get("config")))
