"""What a sweep's table is topped and closed with, from its records alone: the title's count of
timed windows (``windows_text``: what was measured, not what was asked for) and the one line
of conclusion (``conclusion``): which rung wins, by how much over plain, and whether that is
inside the noise; on a busy machine, that it was busy and what that does to the figures. And
each run's line as it ends (``progress_line``).

The noise is the table's: two runs whose windows' ranges meet differ by no result
(``report.within_noise``, the ``~x`` of a cell), and a run marked ``!`` has windows that
disagree or shared its cores with other processes (``report.unstable``, ``kasoku.perf.noise``).
"""
from __future__ import annotations

from kasoku.commands.bench.report import unit, unstable, within_noise
from kasoku.commands.bench.results import median_rate
from kasoku.perf.noise import OTHERS_LIMIT


def windows_text(records: list[dict], asked: int) -> str:
    """``median of 3 windows``, or ``median of 3-9 windows`` where the noise rule took more
    for some runs (``timing.settle``); ``asked`` when no run was measured."""
    counts = sorted({r["figures"]["samples_per_s"]["n"] for r in records if median_rate(r)})
    if not counts:
        counts = [asked]
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"median of {n} window{'s' * (n != '1')}"


def busy(records: list[dict]) -> dict | None:
    """How busy other processes kept the runs' CPUs, None when they left them alone (as
    ``MachineState.reasons`` reads it): ``{"runs", "of", "cores_taken", "cores", "load"}``,
    the runs disturbed of those measured, the most cores taken by others during one, the
    run's cores and the highest load average seen. A busy core seen when a run started
    (``cpu_threads``' note) counts too."""
    measured = [r for r in records if median_rate(r)]
    hit, taken, cores, load = 0, 0.0, 0, 0.0
    for r in measured:
        machine = ((r["figures"].get("stability") or {}).get("machine") or {})
        n = machine.get("cores") or len(machine.get("cpus") or []) or 1
        others = machine.get("others_cores")
        started_busy = bool(((r.get("settings") or {}).get("cpu_threads") or {}).get("note"))
        if (others is not None and others >= max(OTHERS_LIMIT, 0.1 * n)) or started_busy:
            hit += 1
            taken, cores = max(taken, others or 0.0), max(cores, n)
            load = max(load, machine.get("load_avg") or 0.0)
    if not hit:
        return None
    return {"runs": hit, "of": len(measured), "cores_taken": taken, "cores": cores,
            "load": load or None}


def _busy_clause(state: dict) -> str:
    load = f", load {state['load']:.1f}" if state.get("load") else ""
    return (f"the machine was busy (other processes took up to {state['cores_taken']:.1f} of "
            f"the run's {state['cores']} cores in {state['runs']} of {state['of']} "
            f"runs{load}): its rates run below a quiet machine's and swing from run to run; "
            f"measure again when it is quiet")


def _pair(records: list[dict]):
    """``(batch size, plain's record, the fastest other rung's)`` at the largest batch size
    where plain and another rung with sound numerics were both measured; None without one."""
    for bs in sorted({r["batch_size"] for r in records}, reverse=True):
        cells = [r for r in records if r["batch_size"] == bs and median_rate(r)]
        plain = next((r for r in cells if r["rung"] == "plain"), None)
        others = [r for r in cells if r["rung"] != "plain"
                  and (r.get("numerics") or {}).get("status") != "FAIL"]
        if plain is not None and others:
            return bs, plain, max(others, key=median_rate)
    return None


def _range(record: dict) -> str:
    s = record["figures"]["samples_per_s"]
    return f"{s['min']:,.0f}-{s['max']:,.0f}"


def conclusion(records: list[dict], more: str | None = None) -> str:
    """The sweep's closing line (``conclusion: ...``): at the largest batch size with plain
    and another rung measured, the fastest rung, its ratio over plain, and whether the
    difference is outside the noise (the two runs' windows' ranges apart) or inside it (they
    meet: no rung is shown faster). A win is claimed only on stable figures: where either run
    is marked ``!`` the lead is said as one to measure again. A busy machine (``busy``) is
    said with what it does to the figures. ``more``: what to run for more (the whole ladder),
    said at the end."""
    pair = _pair(records)
    state = busy(records)
    tail = (f"; {_busy_clause(state)}" if state else "") + (f"; {more}" if more else "")
    if pair is None:
        return ("conclusion: no rung to compare with plain (plain and another rung were not "
                "both measured at one batch size)" + tail)
    bs, plain, best = pair
    ratio = median_rate(best) / median_rate(plain)
    per_s = unit(records)
    rates = f"{median_rate(best):,.0f} against {median_rate(plain):,.0f} {per_s}"
    ranges = f"windows {best['rung']} {_range(best)}, plain {_range(plain)}"
    rough = " and ".join(r["rung"] for r in (best, plain) if unstable(r))
    marked = f"{rough} marked ! (windows that disagree or cores shared)"
    if within_noise(best, plain):
        lead = (f"{best['rung']} measured fastest at bs {bs}, {ratio:.2f}x plain ({rates}), "
                if ratio > 1 else f"no rung beat plain at bs {bs} (the fastest, "
                f"{best['rung']}, {ratio:.2f}x plain), ")
        text = (f"{lead}inside the noise ({ranges}: they meet): no rung is shown faster than "
                f"plain here" + (f"; {marked}" if rough else ""))
    elif ratio > 1 and not rough:
        text = (f"{best['rung']} wins at bs {bs}: {ratio:.2f}x plain ({rates}), outside the "
                f"noise ({ranges}: apart)")
    elif ratio > 1:
        text = (f"{best['rung']} measured fastest at bs {bs}, {ratio:.2f}x plain ({rates}), "
                f"outside the noise of the windows ({ranges}: apart) but on figures of "
                f"{marked}: a lead, not a result")
    else:
        text = (f"no rung beat plain at bs {bs}: the fastest, {best['rung']}, is "
                f"{ratio:.2f}x plain ({rates}), outside the noise ({ranges}: apart)"
                + (f"; {marked}: rough" if rough else ""))
    return f"conclusion: {text}{tail}"


def progress_line(rec: dict) -> str:
    """A run's line as the sweep prints it when the run ends: its rate, spread and times,
    or its failure; the verdict's rule, a numerics failure and the kernels' split."""
    if rec["status"] != "ok":
        return f"{rec['status'].upper()}: {rec.get('error')}  ({rec['wall_s']:.1f} s)"
    f = rec["figures"]
    s = f["samples_per_s"]
    text = (f"{s['median']:,.0f} {rec.get('unit', 'samples')}/s (min {s['min']:,.0f}, "
            f"max {s['max']:,.0f}, "
            f"n {s['n']}), warm-up {f['warmup_s']:.1f} s, {rec['wall_s']:.1f} s in all")
    if (rec.get("verdict") or {}).get("rule"):
        text += f", {rec['verdict']['rule']}"
    if rec["numerics"].get("status") == "FAIL":
        text += "  NUMERICS FAIL"
    k = f.get("kernels")
    if k:
        what = "kernels" if k["device"] == "cuda" else "operators"
        split = ", ".join(f"{c} {ms:.2f}" for c, ms in k["by_category_ms_per_step"].items()
                          if ms > 0)
        text += (f"\n      {what}: {k['kernel_ms_per_step']:.2f} of {k['wall_ms_per_step']:.2f}"
                 f" ms per step ({split})")
    return text
