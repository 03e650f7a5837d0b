"""Whether ``kasoku scale`` may conclude from its figures (``kasoku.perf.noise``'s rule, as
bench applies it): a worker count's speed-up and efficiency rest on three timed figures, its
data-parallel step, its step alone and the baseline's step alone; the worker already took
more windows where they disagreed. When one of them is still unstable, the line says so, gives
the range the efficiency could lie in from the windows' extremes, and draws no cause from it;
the table marks the speed-up and efficiency ``!`` and the chart draws the range and hatches
the bars (``mark_chart``)."""
from __future__ import annotations

from kasoku.core.flags import flag


def unstable_parts(r: dict, base: dict) -> list[str]:
    """The figures ``r``'s speed-up rests on that are marked unstable, named (``1 worker's
    step alone``); [] when all passed the noise check (or carry no verdict)."""
    n = r["world_size"]
    workers = f"{n} worker{'s' * (n != 1)}'"
    parts = [(r.get("stability"), f"{workers}{'s' * (n == 1)} data-parallel step"),
             (r.get("alone_stability"), f"{workers}{'s' * (n == 1)} step alone")]
    if base is not r:
        b = base["world_size"]
        parts.append((base.get("alone_stability"),
                      f"{b} worker{'s' * (b != 1)}'{'s' * (b == 1)} step alone (the baseline)"))
    return [name for stability, name in parts if stability and not stability.get("stable", True)]


def efficiency_range(r: dict, base: dict, efficiency: float) -> tuple[float, float] | None:
    """The lowest and highest efficiency the windows allow: the efficiency is the baseline's
    step alone over ``r``'s data-parallel step, each taken at its fastest and slowest window.
    None when the records hold no windows' range."""
    s, b = r.get("stability") or {}, base.get("alone_stability") or {}
    try:
        low = efficiency * (b["min"] / b["median"]) * (s["median"] / s["max"])
        high = efficiency * (b["max"] / b["median"]) * (s["median"] / s["min"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return low, high


def withheld(row: dict) -> str:
    """What replaces the causes on a line whose figures are unstable."""
    low_high = row.get("efficiency_range")
    span = (f"; from their windows the efficiency lies anywhere from {low_high[0]:.0%} to "
            f"{low_high[1]:.0%}" if low_high else "")
    return (f", but the figures it rests on are unstable ({', '.join(row['unstable'])}: the "
            f"! lines below say why){span}, so no cause is drawn from it: measure again on a "
            f"quieter machine, or with more {flag('scale.windows')}")


def mark_chart(ax, bx, bars: list, rows: list[dict]) -> None:
    """On ``kasoku scale``'s chart: each unstable worker count's throughput (on ``ax``) drawn
    with the range its efficiency allows (a whisker) and a hollow point, and its step's bars
    (``bars``: the containers ``bx.bar`` returned) hatched, as bench hatches its unstable
    bars, ``bx``'s title saying so (after its legend is drawn: the legend's swatches stay
    plain)."""
    marked = False
    for i, row in enumerate(rows):
        if not row.get("unstable"):
            continue
        marked = True
        rate, n = row["samples_per_s"], row["world_size"]
        low_high = row.get("efficiency_range")
        if low_high:
            per = rate / row["efficiency"]
            ax.errorbar([n], [rate], yerr=[[rate - low_high[0] * per],
                                          [low_high[1] * per - rate]],
                        fmt="o", mfc="white", color="C0", capsize=4)
            ax.set_ylim(0, max(ax.get_ylim()[1], 1.1 * low_high[1] * per))
        for container in bars:
            container.patches[i].set_hatch("//")
            container.patches[i].set_edgecolor("white")
    if marked:
        bx.set_title("hatched //: unstable, no conclusion drawn (the ! lines say why)",
                     fontsize=9)
