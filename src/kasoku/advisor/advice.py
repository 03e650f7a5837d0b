"""Advice that is measured before it is given: the candidate levers of a verdict, each run
beside the run as given (``kasoku.commands.ab`` starts the processes), judged by one noise
rule, and the verdict's lever replaced by the best one measured.

The rule (``Outcome``): in each round the run as given and each candidate run one after the
other in fresh processes, so a drift of the machine moves both; a candidate's ratio is the
median over rounds of its rate over the run as given in the same round. The noise is the
larger of ``MIN_EFFECT`` and the relative spread of either side's rates (over the rounds; with
one round, over the windows of each process). Faster: ratio >= 1 + noise; slower: ratio <=
1 / (1 + noise); otherwise within the noise, and no claim is made.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from kasoku.advisor.levers import Lever
from kasoku.perf.noise import spread

MIN_EFFECT = 0.05
"""No lever is called faster or slower for less than 5%, however quiet the machine."""


@dataclass
class Outcome:
    """A candidate lever measured against the run as given."""
    lever: Lever
    base: list[float] = field(default_factory=list)
    """The run as given, samples/s, one per round (the round the candidate ran in)."""
    rates: list[float] = field(default_factory=list)
    """The candidate, samples/s, one per round."""
    base_windows: list[float] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)
    """Each process's timed windows, for the noise of a single round."""
    error: str | None = None

    @property
    def ratios(self) -> list[float]:
        return [r / b for r, b in zip(self.rates, self.base) if b > 0]

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def noise(self) -> float:
        many = len(self.rates) >= 2
        sides = (self.base, self.rates) if many else (self.base_windows, self.windows)
        spreads = [spread(s).spread for s in sides if s]
        return max([MIN_EFFECT, *spreads])

    @property
    def result(self) -> str:
        """``faster``, ``slower``, ``within noise`` or ``not measured``."""
        ratio = self.ratio
        if ratio is None:
            return "not measured"
        if ratio >= 1 + self.noise:
            return "faster"
        if ratio <= 1 / (1 + self.noise):
            return "slower"
        return "within noise"

    @property
    def text(self) -> str:
        """``measured 1.31x (1.28-1.35 over 3 rounds), faster`` or why not measured."""
        if self.ratio is None:
            return f"not measured: {self.error or 'no rate'}"
        ratios = self.ratios
        span = (f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds"
                if len(ratios) > 1 else f"1 round, noise {100 * self.noise:.0f}%")
        return f"measured {self.ratio:.2f}x ({span}), {self.result}"

    def to_dict(self) -> dict:
        return {"args": list(self.lever.args), "text": self.text, "lever": self.lever.text,
                "ratio": self.ratio, "ratios": self.ratios, "noise": self.noise,
                "result": self.result, "base": self.base, "rates": self.rates,
                "error": self.error, "caveat": self.lever.caveat}


def short(outcome: dict) -> str:
    """``--precision bf16 0.74x, slower`` for a list of what was tried."""
    if outcome.get("ratio") is None:
        return f"{' '.join(outcome['args'])}: {outcome['text']}"
    return f"{' '.join(outcome['args'])} {outcome['ratio']:.2f}x, {outcome['result']}"


def advise(verdict, outcomes: list[Outcome]):
    """``verdict`` (``kasoku.advisor.verdict.Verdict``) with its lever the fastest
    candidate measured faster, its ``tried`` list every outcome (fastest first), and, where
    none was faster, a lever that says so and what was tried."""
    if not outcomes:
        return verdict
    ordered = sorted(outcomes, key=lambda o: -(o.ratio or 0.0))
    tried = [o.to_dict() for o in ordered]
    best = next((o for o in ordered if o.result == "faster"), None)
    if best is not None:
        lever = best.lever.measured_as(best.to_dict())
    else:
        then = getattr(verdict, "fallback", None)
        lever = Lever("none of the levers tried was faster here (tried: "
                      + "; ".join(short(t) for t in tried) + ")"
                      + (f"; {then.text}" if then is not None and not then.change else ""),
                      "", measured={"result": "none faster"})
    return replace(verdict, lever=lever, tried=tried)
