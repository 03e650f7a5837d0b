"""The A/B runs of ``kasoku profile``, each side a fresh ``kasoku profile --measure-only``
process (the run as given, or with a lever's change added as arguments, ``Lever.args``: a
later flag wins). The one place a lever turns back into a command line:

- ``try_levers``: the verdict's candidate levers, in rounds (the run as given, then each
  candidate), as long as the rounds fit the time budget; judged by
  ``kasoku.advisor.advice`` (the advice);
- ``confirm``: the rule's experiments, which prove the bound, and the advised lever once more
  (``--confirm``).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from kasoku.advisor.advice import Outcome, short
from kasoku.advisor.levers import Lever
from kasoku.advisor.verdict import MIN_GAIN, Experiment, Verdict
from kasoku.core.flags import option, without

ROUNDS = 3
"""Rounds of the tries where the time allows (the medians over rounds are the figures)."""
BUDGET_S = 60.0
"""The tries stop after the round that would take them past this (one round at least)."""
SIDE_TIMEOUT_S = 900.0

_OWN_FLAGS = {option(name): values for name, values in (
    ("confirm", 0), ("python", 0), ("out", 1), ("measure_only", 0), ("estimate", 0),
    ("rounds", 1))}
"""``kasoku profile``'s options that say what this profile writes, not the run: each with the
number of values it takes."""


def without_own(argv: list[str]) -> list[str]:
    """The ``kasoku profile`` arguments that choose the run (not this profile's outputs)."""
    return without(argv, _OWN_FLAGS)


def measure_side(argv: list[str], timeout_s: float = SIDE_TIMEOUT_S) -> dict:
    """One fresh ``kasoku profile ARGV --measure-only`` process: ``{"samples_per_s",
    "window_rates", "phases"}``, or ``{"error": its last line}``."""
    cmd = [sys.executable, "-m", "kasoku", *argv, option("measure_only")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": err.removeprefix("kasoku: error: ")}
    data = json.loads(lines[-1])
    if data.get("recompiles"):  # compilation inside the timed steps: not the lever's rate
        return {"error": f"torch.compile recompiled {data['recompiles']} graph(s) while the "
                         f"steps were timed"}
    return {"samples_per_s": data["samples_per_s"], "phases": data["phases"],
            "window_rates": data.get("window_rates") or [data["samples_per_s"]]}


def try_levers(argv: list[str], candidates: list[Lever], say=None,
               rounds: int = ROUNDS, budget_s: float = BUDGET_S, measure=None
               ) -> list[Outcome]:
    """Each candidate's ``Outcome``: ``rounds`` rounds of the run as given followed by each
    candidate, stopped early after a round when another would pass ``budget_s``; a candidate
    that fails is not run again. ``measure(extra_args)`` runs one side (default: ``kasoku
    ARGV EXTRA --measure-only``, ``measure_side``; a script's sides are
    ``kasoku.commands.script_ab``'s)."""
    base_argv = without_own(argv)
    measure = measure or (lambda extra: measure_side(base_argv + list(extra)))
    outcomes = [Outcome(c) for c in candidates if c.args]
    if not outcomes:
        return []
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    for done in range(rounds):
        base = measure(())
        if "error" in base:
            for o in outcomes:
                o.error = o.error or f"the run as given failed: {base['error']}"
            break
        for o in outcomes:
            if o.error:
                continue
            say(f"  {' '.join(o.lever.args)} (round {done + 1} of {rounds}) ...")
            side = measure(o.lever.args)
            if "error" in side:
                o.error = side["error"]
                continue
            o.base.append(base["samples_per_s"])
            o.rates.append(side["samples_per_s"])
            if not o.base_windows:
                o.base_windows, o.windows = base["window_rates"], side["window_rates"]
        elapsed = time.perf_counter() - t0
        if elapsed * (done + 2) / (done + 1) > budget_s:
            if done + 1 < rounds:
                say(budget_line(done + 1, rounds, budget_s, elapsed))
            break
    return outcomes


def budget_line(done: int, rounds: int, budget_s: float, elapsed_s: float) -> str:
    """Why the tries stopped after ``done`` of ``rounds`` rounds: another would have taken
    them past ``budget_s`` (``elapsed_s`` so far)."""
    return (f"  stopped after round {done} of {rounds}: the {budget_s:.0f} s budget for the "
            f"tries ({elapsed_s:.0f} s so far; another round would pass it; fewer rounds "
            f"make the figures noisier)")


def confirm(argv: list[str], experiments: list[Experiment], lever: Lever,
            rounds: int = ROUNDS, measure=None, command=None, say=None) -> list[dict]:
    """The verdict's ``experiments``, which prove the bound, then the advised ``lever`` when it
    was measured faster, each beside the run as given in ``rounds`` interleaved rounds (as
    ``try_levers``): a row per side with the median ratio, what was predicted (``MIN_GAIN``:
    at least 10% faster, or less than that) and the outcome: confirmed, refuted, or
    inconclusive where the ratio is within the rounds' noise of ``MIN_GAIN``.
    ``measure`` and ``say`` as ``try_levers``; ``command(args)``: the command line a row
    shows (default: ``kasoku ARGV ARGS``)."""
    sides = [(Lever(e.label, "", e.change), e.faster, "the bound") for e in experiments]
    if (lever.measured or {}).get("result") == "faster":
        sides.append((Lever(f"the advice: {' '.join(lever.args)}", "", lever.change), True,
                      "the advice"))
    outcomes = try_levers(argv, [side for side, _, _ in sides], rounds=rounds,
                          budget_s=float("inf"), measure=measure, say=say)
    command = command or (lambda args: " ".join(["kasoku", *without_own(argv), *args]))
    base = [b for o in outcomes for b in o.base]
    rows = [{"label": "as given", "samples_per_s": statistics.median(base) if base else None,
             "ratio": 1.0, "expected": "", "outcome": "", "proves": ""}]
    for (side, faster, proves), o in zip(sides, outcomes):
        label, args, ratio = side.text, side.args, o.ratio
        if ratio is None:
            outcome = f"not measured: {o.error or 'failed'}"
        elif MIN_GAIN / (1 + o.noise) < ratio < MIN_GAIN * (1 + o.noise):
            # within the noise of the threshold: the rounds cannot tell which side it is on
            outcome = f"inconclusive: the rounds' noise is {100 * o.noise:.0f}%"
        else:
            outcome = "confirmed" if (ratio >= MIN_GAIN) == faster else "refuted"
        rows.append({"label": label, "args": " ".join(args),
                     "command": command(args),
                     "samples_per_s": statistics.median(o.rates) if o.rates else None,
                     "ratio": ratio, "noise": o.noise, "rounds": len(o.rates),
                     "expected": f">= {MIN_GAIN:.2f}x" if faster else f"< {MIN_GAIN:.2f}x",
                     "outcome": outcome, "proves": proves})
    return rows


def ladder_lines(rows: list[dict] | None) -> list[str]:
    """The ``--confirm`` rows (``confirm``'s, a result's ``ladder``): label, samples/s,
    ratio, what was predicted, the outcome, and what the row proves (the bound, or the
    advice)."""
    rows = rows or []
    lines = ["confirm (fresh processes; the bound's proof, then the advice):"] if rows else []
    for row in rows:
        rate = row.get("samples_per_s")
        shown = f"{rate:10.1f}/s" if rate else "     n/a   "
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") else ""
        proves = f" ({row['proves']})" if row.get("proves") else ""
        lines.append(f"  {row['label'][:44]:44s} {shown} {ratio:>6s} {row.get('expected', ''):>8s}"
                     f"  {row.get('outcome') or row.get('error', '')}{proves}")
    return lines


def tried_lines(verdict: Verdict) -> list[str]:
    """The candidate levers as measured, fastest first (``kasoku.advisor.advice``),
    where the verdict's line does not list them already."""
    if not verdict.tried or "(tried: " in verdict.line:
        return []
    return ["  tried: " + "; ".join(short(t) for t in verdict.tried)]
