"""How far each kernel class of a GPU step is from its limit: its time per step, the work it
does (``kasoku.perf.profile.work``), its achieved rate, its roof, the time it would take at
the roof and the milliseconds the step would save there (its gap).

The roofs are measured on the machine, as MFU's peak is (``kasoku.perf.peak``): the matrix
products' peak for each dtype the step's products run in (the math: matrix products,
convolutions, attention), the device memory's copy bandwidth for the rest. A class's time at
the roof is the slower of its FLOPs at the peak and its bytes at the bandwidth (a roofline:
a small product is limited by its bytes). Its gap is its time, for the part of it whose work
is known, less that; never below zero (``over``: a class faster than its roof allows, its
products at the measured peak, or its bytes overcounted: kernels that skip parts of their
arguments). A class whose work is unknown (collectives; an optimizer whose update was not
counted) has no gap, and says so.

The rows add up to the device's busy time, less what ran at once on two streams (its own
row, negative); the step's idle rest is its own row, so that the table adds up to the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from kasoku.perf.peak import measure_bandwidth, measure_matmul_peak
from kasoku.perf.profile.kernels import KERNEL_CLASSES
from kasoku.perf.profile.work import ClassWork

MATH = ("matmul/conv", "attention")
"""The classes judged by their FLOPs; the others by their bytes."""
UNJUDGED = ("communication", "input")
"""Classes shown and never judged against a roof: the collectives (their limit is the links'),
a GPU loader's kernels (not the model's work)."""
NO_CHEAP_LEVER_PCT = 10.0
"""The classes' gaps add up to less than this % of the step: no cheap lever left."""


@dataclass(frozen=True)
class Roofs:
    """The measured limits: ``flops_per_s`` per dtype (``bf16``, ``fp16``, ``tf32``,
    ``fp32``), ``bytes_per_s`` the memory's copy rate."""
    flops_per_s: dict
    bytes_per_s: float

    def flop_time_s(self, flop_by_dtype: dict) -> float:
        return sum(f / self.flops_per_s[dt] for dt, f in flop_by_dtype.items()
                   if self.flops_per_s.get(dt))

    def to_dict(self) -> dict:
        return {"flops_per_s": dict(self.flops_per_s), "bytes_per_s": self.bytes_per_s}


def peak_dtype(dtype: str, tf32: bool) -> str:
    """The peak a product of ``dtype`` runs at: fp32 products on TF32 cores where allowed."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def measure_roofs(device, dtypes, tf32: bool) -> Roofs:
    """The matmul peak of each of ``dtypes`` (``work.dtype_of``'s) and the copy bandwidth,
    measured on ``device``."""
    peaks = {dt: measure_matmul_peak(device, peak_dtype(dt, tf32)).flops_per_s
             for dt in sorted(set(dtypes))}
    return Roofs(peaks, measure_bandwidth(device).bytes_per_s)


def roofline(by_class_ms: dict, work: dict[str, ClassWork], roofs: Roofs,
             optimizer_bytes: float | None = None, busy_ms: float | None = None) -> dict:
    """The table: one row per class that ran (``by_class_ms``: the window's kernel time per
    step), its ``work`` per step (from the work step), judged against ``roofs``;
    ``optimizer_bytes``: the update's bytes where the caller counted them; ``busy_ms``: the
    device's busy time per step (less than the classes' sum where streams ran kernels at
    once). JSON-ready."""
    rows = []
    for cls in KERNEL_CLASSES:
        ms = by_class_ms.get(cls, 0.0)
        if ms <= 0:
            continue
        w = work.get(cls) or ClassWork()
        seen_us = w.known_us + w.unknown_us
        known = w.known_us / seen_us if seen_us else 0.0
        if cls == "optimizer" and optimizer_bytes and not w.bytes:
            # the update's tensor lists carry no shapes: its bytes as the caller counted them,
            # for all of its time
            w, known = ClassWork(bytes=optimizer_bytes), 1.0
        row = {"class": cls, "ms": ms, "known_pct": 100 * known, "flop": w.flop,
               "bytes": w.bytes, "unit": "TFLOP/s" if cls in MATH else "GB/s"}
        if known == 0.0 or (not w.flop and not w.bytes) or cls in UNJUDGED:
            rows.append({**row, "rate": None, "roof": None, "roof_ms": None, "gap_ms": None})
            continue
        known_ms = ms * known
        flop_s = roofs.flop_time_s(w.flop_by_dtype or {}) if w.flop else 0.0
        roof_ms = 1e3 * max(flop_s, w.bytes / roofs.bytes_per_s)
        if cls in MATH and w.flop:
            rate, scale = w.flop / known_ms / 1e9, 1e12
            # The roof: the peak of the dtype most of the FLOPs ran in.
            dt = max(w.flop_by_dtype or {"fp32": 1.0}, key=(w.flop_by_dtype or {}).get)
            roof = roofs.flops_per_s.get(dt, 0.0) / scale
        else:
            rate, roof = w.bytes / known_ms / 1e6, roofs.bytes_per_s / 1e9
        rows.append({**row, "rate": rate, "roof": roof, "roof_ms": roof_ms,
                     "gap_ms": max(0.0, known_ms - roof_ms), "over": known_ms < roof_ms})
    known_gaps = [r["gap_ms"] for r in rows if r["gap_ms"] is not None]
    return {"classes": rows, "gap_ms": sum(known_gaps),
            "unknown_ms": sum(r["ms"] for r in rows if r["gap_ms"] is None)
            + sum(r["ms"] * (1 - r["known_pct"] / 100) for r in rows if r["gap_ms"] is not None),
            "busy_ms": busy_ms, "roofs": roofs.to_dict()}


def largest_gap(table: dict) -> dict | None:
    """The row with the most to gain, or None when no class has a gap."""
    rows = [r for r in table.get("classes", []) if r.get("gap_ms")]
    return max(rows, key=lambda r: r["gap_ms"]) if rows else None


def gap_pct(table: dict, step_ms: float) -> float:
    return 100 * table["gap_ms"] / step_ms if step_ms else 0.0


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table_rows(table: dict, step_ms: float) -> list[list[str]]:
    """The rows as printed: class, ms, % of the step, work, rate, roof, ms at the roof, ms to
    gain; then the kernels' time that overlapped (streams running at once) and the step's
    idle rest, so that the ms add up to the step."""
    out = []
    for r in table["classes"]:
        work = (f"{r['flop'] / 1e12:.2f} TFLOP" if r["unit"] == "TFLOP/s" and r["flop"]
                else f"{r['bytes'] / 1e9:.2f} GB" if r["bytes"]
                else "not judged" if r["class"] in UNJUDGED else "unknown")
        rate = "-" if r["rate"] is None else f"{r['rate']:,.0f} {r['unit']}"
        roof = "-" if r["roof"] is None else f"{r['roof']:,.0f}"
        over = " (at the measured peak)" if r["unit"] == "TFLOP/s" else " (bytes overcounted)"
        gap = _num(r["gap_ms"]) + (over if r.get("over") else "")
        if r["gap_ms"] is not None and r["known_pct"] < 99.5:
            gap += f" (of the {r['known_pct']:.0f}% with known work)"
        out.append([r["class"], _num(r["ms"]), f"{100 * r['ms'] / step_ms:.0f}%", work, rate,
                    roof, _num(r["roof_ms"]), gap])
    total = sum(r["ms"] for r in table["classes"])
    busy = table.get("busy_ms") or total
    if total > busy * 1.001:
        out.append(["overlapped (streams at once)", _num(busy - total),
                    f"{100 * (busy - total) / step_ms:.0f}%", "", "", "", "", ""])
    if step_ms > busy:
        out.append(["idle (no kernel)", _num(step_ms - busy),
                    f"{100 * (step_ms - busy) / step_ms:.0f}%", "", "", "", "", ""])
    return out


HEADER = ["class", "ms/step", "share", "work/step", "rate", "roof", "ms at roof", "ms to gain"]


def format_table(table: dict, step_ms: float) -> list[str]:
    """The table as aligned lines of text, its title first."""
    rows = [HEADER, *table_rows(table, step_ms)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    peaks = ", ".join(f"{dt} {v / 1e12:,.0f} TFLOP/s"
                      for dt, v in table["roofs"]["flops_per_s"].items())
    title = (f"time by kernel class against its limit (roofs measured: matmul {peaks}, memory "
             f"copy {table['roofs']['bytes_per_s'] / 1e9:,.0f} GB/s): {table['gap_ms']:.2f} ms "
             f"of the {step_ms:.2f} ms step above the limits")
    return [title] + ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                      for r in rows]


def draw(table: dict, step_ms: float, path, title: str = ""):
    """The picture: per class, its time per step as a bar, the part the roof allows solid and
    the gap hatched. Returns the path (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # classes under 0.5% of the step are left out of the picture (the table has them)
    rows = [r for r in table["classes"] if r["ms"] >= 0.005 * step_ms] or table["classes"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.8))
    names = [r["class"] for r in rows][::-1]
    at_roof = [r["ms"] - (r["gap_ms"] or 0.0) if r["gap_ms"] is not None else 0.0
               for r in rows][::-1]
    gaps = [r["gap_ms"] or 0.0 for r in rows][::-1]
    unknown = [r["ms"] if r["gap_ms"] is None and r["class"] not in UNJUDGED else 0.0
               for r in rows][::-1]
    apart = [r["ms"] if r["class"] in UNJUDGED else 0.0 for r in rows][::-1]
    ax.barh(names, at_roof, color="#4c72b0", label="time the class's limit allows")
    ax.barh(names, gaps, left=at_roof, color="#dd8452", hatch="//", label="above the limit")
    if any(unknown):
        ax.barh(names, unknown, color="#bbbbbb", label="work unknown")
    if any(apart):
        ax.barh(names, apart, color="#8fbf8f", label="not judged (collectives, the loader's)")
    for y, (roof_part, gap) in enumerate(zip(at_roof, gaps)):
        if roof_part + gap > 0:
            ax.text(roof_part + gap, y, f" {roof_part + gap:.1f}" + (f" (+{gap:.1f})" if gap
                                                                      else ""),
                    va="center", fontsize=8)
    ax.set_xlim(0, 1.2 * max(r["ms"] for r in rows))
    ax.set_xlabel("ms per step")
    overlap = sum(r["ms"] for r in table["classes"]) - (table.get("busy_ms") or 0.0)
    overlap_text = (f"; {overlap:.2f} ms of the bars ran at once on two streams"
                    if table.get("busy_ms") and overlap > 0.001 * step_ms else "")
    ax.set_title(title or f"time per kernel class against its limit\nstep {step_ms:.2f} ms, "
                 f"{table['gap_ms']:.2f} ms above the limits{overlap_text}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
