"""The ladder as a terminal table and as a chart, made from result records only."""
from __future__ import annotations

from pathlib import Path

from kasoku.accel.loader_cores import describe
from kasoku.commands.bench.results import median_rate, read_results
from kasoku.commands.bench.rung_advice import amended
from kasoku.commands.table import print_table
from kasoku.perf.cpuinfo import describe_peak
from kasoku.perf.noise import ranges_meet


def unit(records: list[dict]) -> str:
    """The records' rate unit: their workload's ("images/s" for image models, else
    "samples/s"); for records older than the ``unit`` field, "images/s" for inputs of shape
    C x H x W."""
    for r in records:
        if r.get("unit"):
            return f"{r['unit']}/s"
    for r in records:
        shape = (r.get("data") or {}).get("input_shape")
        if shape is not None:
            return "images/s" if len(shape) == 3 else "samples/s"
    return "samples/s"


def data_label(records: list[dict]) -> str:
    """Where the batches came from: "synthetic on-device", and each loader rung's source."""
    fed = dict.fromkeys(f"{r['rung']} fed by the {r['data']['source']}" for r in records
                        if (r.get("data") or {}).get("loader"))
    return "; ".join(["synthetic on-device", *fed])


def _grid(records: list[dict]):
    rungs = list(dict.fromkeys(r["rung"] for r in records))
    sizes = sorted({r["batch_size"] for r in records})
    cells = {(r["rung"], r["batch_size"]): r for r in records}
    return rungs, sizes, cells


def unstable(record: dict) -> bool:
    """Whether a run's rate is marked unstable (``kasoku.perf.noise``)."""
    return not ((record.get("figures") or {}).get("stability") or {}).get("stable", True)


def within_noise(a: dict, b: dict) -> bool:
    """Whether two runs' window ranges meet: their difference is no result."""
    return ranges_meet(a["figures"]["samples_per_s"], b["figures"]["samples_per_s"])


def speedup_text(record: dict, plain: dict | None) -> str:
    """``x1.52`` over plain at the same batch size, ``~x1.02`` where the two ranges meet (no
    claim), "" without a plain rate."""
    base = median_rate(plain) if plain is not None and plain["status"] == "ok" else None
    if not base:
        return ""
    noisy = plain is not record and within_noise(record, plain)
    return f"{'~' if noisy else ''}x{median_rate(record) / base:.2f}"


def _cell(record: dict | None, plain: dict | None) -> str:
    if record is None:
        return "-"
    if record["status"] != "ok":
        return record["status"].upper() if record["status"] == "oom" else record["status"]
    rate = median_rate(record)
    text = f"{rate:,.0f}" + ("!" if unstable(record) else "")
    ratio = speedup_text(record, plain)
    if ratio:
        text += f" {ratio}"
    mfu = record["figures"].get("mfu")
    if mfu is not None:
        text += f" {100 * mfu:.0f}%"
    if record.get("numerics", {}).get("status") == "FAIL":
        text += " NUMERICS FAIL"
    return text


def _rule(record: dict) -> str | None:
    """The bottleneck verdict's rule of a run ("compute-bound"), None when none was judged."""
    return (record.get("verdict") or {}).get("rule")


def short_rule(rule: str) -> str:
    """A rule as the table's column shows it: without its family ("memory-bound" for
    "device-bound (memory-bound)"; the lines under the table keep the whole rule)."""
    name = rule.partition(" (")[2]
    return name[:-1] if name.endswith(")") else rule


def bottleneck(runs: list[dict]) -> str:
    """The bottleneck column of one rung, from its runs in batch-size order: the verdict's
    rule (``short_rule``); where it changes with the batch size, each rule with its sizes
    ("host-bound (32, 64) / memory-bound (128)"); "-" when no run was judged."""
    sizes: dict[str, list[str]] = {}
    for r in runs:
        if _rule(r):
            sizes.setdefault(short_rule(_rule(r)), []).append(str(r["batch_size"]))
    if len(sizes) <= 1:
        return next(iter(sizes), "-")
    return " / ".join(f"{rule} ({', '.join(bs)})" for rule, bs in sizes.items())


def verdict_lines(records: list[dict]) -> list[str]:
    """What goes under the table: ``RUNG (bs N): LINE`` for each rung and rule it got, at the
    largest batch size of that rule (the others are in results.jsonl), with what the next rung
    measured of its advice (``rung_advice.amended``); for a rung never judged, why (its profiled
    window failed, or its verdict could not be judged)."""
    rungs, sizes, cells = _grid(records)
    lines = []
    for i, rung in enumerate(rungs):
        runs = [cells[(rung, bs)] for bs in sizes if (rung, bs) in cells]
        latest = {_rule(r): r for r in runs if _rule(r)}  # sizes ascend: the largest wins
        for r in latest.values():
            following = next((cells[(q, r["batch_size"])] for q in rungs[i + 1:]
                              if (q, r["batch_size"]) in cells), None)
            lines.append(f"{rung} (bs {r['batch_size']}): {amended(r, following)}")
        if latest:
            continue
        for r in reversed(runs):
            error = ((r["figures"].get("profile") or {}).get("error")
                     or (r.get("verdict") or {}).get("error"))
            if r["status"] == "ok" and error:
                lines.append(f"{rung} (bs {r['batch_size']}): no verdict: {error}")
                break
    return lines


def skip_lines(records: list[dict]) -> list[str]:
    """``RUNG: why`` for each rung the ladder skipped on this machine."""
    reasons = {r["rung"]: r.get("error") for r in records if r["status"] == "skipped"}
    return [f"{rung}: {why}" for rung, why in reasons.items()]


def slower_lines(records: list[dict]) -> list[str]:
    """A line for each rung slower than the measured rung above it at some batch size, by
    more than the spread of either's windows, with its bottleneck verdict where it has one:
    a rung that adds a lever and loses speed must say so, not leave a reader guessing."""
    rungs, sizes, cells = _grid(records)
    lines = []
    for bs in sizes:
        above = None
        for rung in rungs:
            r = cells.get((rung, bs))
            if r is None or median_rate(r) is None or rung == "plain":
                continue
            if above is not None:
                s, t = r["figures"]["samples_per_s"], above["figures"]["samples_per_s"]
                if s["max"] < t["min"]:
                    why = (feeding_reason(r, above) or (r.get("verdict") or {}).get("line")
                           or "no verdict")
                    lines.append(f"{rung} (bs {bs}) is slower than {above['rung']} "
                                 f"(x{s['median'] / t['median']:.2f}): {why}")
            above = r
    return lines


def _fed(record: dict) -> bool:
    return bool((record.get("data") or {}).get("loader"))


def feeding_reason(fed: dict, above: dict) -> str | None:
    """Why a rung fed by a loader (``+loader``) is slower than the same step on synthetic
    batches above it, from both runs' profiled windows: the step against the step, the GPU's
    idle share, the loader's own kernels and host-to-device copies beside the model's. The
    model's verdict would only repeat the rung above's. None without both profiles."""
    if not _fed(fed) or _fed(above):
        return None
    p = (fed.get("figures") or {}).get("profile") or {}
    q = (above.get("figures") or {}).get("profile") or {}
    if not p.get("step_ms") or not q.get("step_ms") or p.get("busy_pct") is None \
            or q.get("busy_pct") is None:
        return None
    loader = (fed.get("data") or {}).get("loader")
    idle, idle_before = 100 - p["busy_pct"], 100 - q["busy_pct"]
    parts = [f"the step takes {p['step_ms']:.1f} ms against {q['step_ms']:.1f} ms on "
             f"synthetic batches on the device",
             f"the GPU idles {idle:.0f}% of it (against {idle_before:.0f}%)"
             + (f", {p['idle_data_pct']:.0f}% of it waiting for batches"
                if (p.get("idle_data_pct") or 0) >= 0.5 else "")]
    own = (p.get("by_class_ms") or {}).get("input") or 0.0
    if own >= 0.05:
        parts.append(f"the loader's kernels (decoding, crops) take {own:.2f} ms of the GPU "
                     f"per step beside the model's")
    if (p.get("h2d_ms") or 0) >= 0.05:
        parts.append(f"host-to-device copies {p['h2d_ms']:.2f} ms per step"
                     + (" from pageable memory" if p.get("h2d_pageable") else ""))
    return f"feeding, not the model ({loader}): " + "; ".join(parts)


def unstable_lines(records: list[dict]) -> list[str]:
    """``RUNG (bs N): why`` for each run whose rate is marked unstable (``!``)."""
    return [f"{r['rung']} (bs {r['batch_size']}): "
            + "; ".join(r["figures"]["stability"].get("reasons") or ["unstable"])
            for r in records if r["status"] == "ok" and unstable(r)]


def busy_core_lines(records: list[dict]) -> list[str]:
    """The cores other processes kept busy when the runs started (``apply_cpu_threads``)."""
    notes = [((r.get("settings") or {}).get("cpu_threads") or {}).get("note") for r in records]
    return list(dict.fromkeys(n for n in notes if n))


def threads_label(records: list[dict]) -> str | None:
    """``2 threads (1 inter-op), one per physical core`` from the runs' records (CPU)."""
    for r in records:
        t = (r.get("settings") or {}).get("cpu_threads")
        if t:
            cores = ((r.get("env") or {}).get("cpu") or {}).get("physical_cores")
            per_core = ", one per physical core" if cores == t["threads"] else ""
            pinned = f", pinned to CPUs {t['pinned_cpus']}" if t.get("pinned_cpus") else ""
            return f"{t['threads']} threads ({t['interop_threads']} inter-op){per_core}{pinned}"
    return None


def loader_core_lines(records: list[dict]) -> list[str]:
    """``+loader: 1 compute thread on CPUs [0], 1 loader worker on CPUs [1]``: how a CPU
    loader rung's cores were split (``kasoku.accel.loader_cores``), once per rung and split."""
    lines = [f"{r['rung']}: {describe(t)}" for r in records
             if "loader_workers" in (t := (r.get("settings") or {}).get("cpu_threads") or {})]
    return list(dict.fromkeys(lines))


def peak_lines(records: list[dict]) -> list[str]:
    """The matmul peaks the MFU column is read against: measured, and on a CPU the
    first-principles one beside it with the measured share of it and, on a line of its own,
    what it assumes (the one place a sweep says it: the probe's progress line does not)."""
    lines, seen = [], set()
    for r in records:
        peak = (r.get("figures") or {}).get("peak") or {}
        if "flops_per_s" not in peak or peak.get("dtype") in seen:
            continue
        seen.add(peak["dtype"])
        line = (f"{peak['dtype']} peak: measured {peak['flops_per_s'] / 1e12:.2f} TFLOP/s "
                f"({peak['size']}^3, {peak.get('min_flops_per_s', 0) / 1e12:.2f}-"
                f"{peak.get('max_flops_per_s', 0) / 1e12:.2f} over {peak.get('reps')} runs"
                + ("" if peak.get("stable", True) else ", unstable: MFU against it is rough")
                + ")")
        theory = peak.get("theory")
        if theory:
            line += (f"; first principles {describe_peak(theory)}; "
                     f"measured {100 * peak['flops_per_s'] / theory['flops_per_s']:.0f}% of it"
                     + (f"\n    ({theory['assumptions']})" if theory.get("assumptions") else ""))
        lines.append(line)
    return lines


def print_ladder(records: list[dict], title: str | None = None, file=None) -> None:
    """Rung rows x batch-size columns: median rate, speed-up over ``plain`` at the same batch
    size, MFU; then the bottleneck (``bottleneck``) and the numerics verdict of the rung.
    Under the table: the peaks (``peak_lines``), the cores of a CPU loader rung's step and
    workers (``loader_core_lines``), the rungs skipped on this machine and why
    (``skip_lines``), the rungs slower than the one above (``slower_lines``) and each rung's
    verdict line (``verdict_lines``)."""
    rungs, sizes, cells = _grid(records)
    rows = []
    for rung in rungs:
        runs = [cells[(rung, bs)] for bs in sizes if (rung, bs) in cells]
        checks = {r.get("numerics", {}).get("status") for r in runs}
        numerics = "FAIL" if "FAIL" in checks else "ok" if "ok" in checks else "n/a"
        rows.append([rung, *[_cell(cells.get((rung, bs)), cells.get(("plain", bs)))
                             for bs in sizes], bottleneck(runs), numerics])
    headers = ["rung", *[f"bs {bs}" for bs in sizes], "bottleneck", "numerics"]
    threads = threads_label(records)
    title = ((title or "") + (f", {threads}" if threads else "")
             + f"  [cells: {unit(records)} median (! unstable), x speed-up vs plain (~x: "
               f"within the windows' range of plain's), MFU]")
    print_table(headers, rows, title=title.strip(), file=file)
    for heading, lines in (("unstable figures (!):", unstable_lines(records)),
                           ("busy cores:", busy_core_lines(records)),
                           ("peaks (MFU's denominators):", peak_lines(records)),
                           ("loader cores:", loader_core_lines(records)),
                           ("skipped rungs:", skip_lines(records)),
                           ("slower than the rung above:", slower_lines(records)),
                           ("bottleneck verdicts (a profiled window of each run):",
                            verdict_lines(records))):
        if lines:
            print(heading, file=file)
            for line in lines:
                print(f"  {line}", file=file)


def rung_colors(n: int) -> list:
    """One color per rung, distinct for up to 20 rungs (the GPU ladder has 13, more than
    matplotlib's default cycle of 10): tab10 up to 10, else tab20's dark shades, then its
    light ones."""
    from matplotlib import colormaps
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    tab20 = colormaps["tab20"]
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return [tab20(order[i % 20]) for i in range(n)]


def plot_ladder(records: list[dict], path: Path, title: str) -> Path:
    """Grouped bars as in seed 004: x = batch size, one bar per rung, y = median rate, with
    min-max whiskers; an OOM is written where its bar would stand, a numerics failure is
    hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rungs, sizes, cells = _grid(records)
    fig = Figure(figsize=(max(6.4, 1.2 + 1.1 * len(sizes) * max(1, len(rungs)) / 3), 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(rungs))
    top = max([median_rate(r) or 0.0 for r in records] + [1.0])
    colors = rung_colors(len(rungs))
    handles: list = []
    for i, rung in enumerate(rungs):
        xs, heights, errs, hatches, labels, ceilings = [], [], [[], []], [], [], []
        for j, bs in enumerate(sizes):
            x = j - 0.4 + width * (i + 0.5)
            record = cells.get((rung, bs))
            rate = median_rate(record) if record else None
            if rate is None:
                if record is not None:
                    ax.text(x, top * 0.01, record["status"].upper(), rotation=90, ha="center",
                            va="bottom", fontsize=7)
                continue
            s = record["figures"]["samples_per_s"]
            xs.append(x)
            heights.append(rate)
            errs[0].append(rate - s["min"])
            errs[1].append(s["max"] - rate)
            ceilings.append(s["max"] + top * 0.01)
            hatches.append("FAIL" if record.get("numerics", {}).get("status") == "FAIL"
                           else "unstable" if unstable(record) else None)
            labels.append(speedup_text(record, cells.get(("plain", bs))))
        bars = ax.bar(xs, heights, width, yerr=errs, capsize=2, color=colors[i])
        # the legend's own patch: an empty bar set (a rung skipped here) has no color of its own
        handles.append(Patch(color=colors[i], label=rung if xs else f"{rung} (not run)"))
        for bar, mark, label, ceiling in zip(bars, hatches, labels, ceilings):
            x = bar.get_x() + bar.get_width() / 2
            if label and rung != "plain":  # the speed-up over plain, above the whisker
                many = len(rungs) > 4
                ax.text(x, ceiling, label, rotation=90 if many else 0,
                        ha="center", va="bottom", fontsize=6 if many else 8)
            if mark == "FAIL":
                bar.set_hatch("xx")
                ax.text(x, bar.get_height(), "FAIL", ha="center", va="bottom", fontsize=7,
                        color="red")
            elif mark == "unstable":
                bar.set_hatch("//")
    ax.set_xticks(range(len(sizes)), [str(bs) for bs in sizes])
    ax.set_xlim(-0.5, len(sizes) - 0.5)  # also where only OOM labels stand
    ax.set_xlabel("batch size")
    ax.set_ylabel(unit(records).capitalize())
    ax.set_title(f"{title}\nbars: median, whiskers: min-max of the timed windows; above each "
                 f"bar its speed-up over plain (~: within the noise); hatched //: unstable",
                 fontsize=8)
    longest = max((len(r) for r in rungs), default=0)
    if longest > 24:  # --config specs as labels: below the axes, as wide as they need
        ax.legend(handles=handles, fontsize=7, ncols=max(1, min(len(rungs), 90 // longest)),
                  loc="upper left", bbox_to_anchor=(0.0, -0.14))
    else:
        ax.legend(handles=handles, fontsize=7, ncols=min(4, max(1, len(rungs))),
                  loc="upper left")
    # Room above the highest whisker for its speed-up label (upright or turned) and the legend.
    highest = max([top] + [r["figures"]["samples_per_s"]["max"] for r in records
                           if median_rate(r)])
    ax.set_ylim(0, highest * (1.45 if len(rungs) > 4 else 1.3))
    ax.grid(axis="y", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


def latest_runs(records: list[dict], workload: str, device_type: str) -> list[dict]:
    """The last record of each (rung, batch size) of ``workload`` on ``device_type``, plain
    first and the rest in the order they first appear: what ``--report`` shows after a ladder
    split over several commands."""
    latest: dict = {}
    for r in records:
        if r.get("workload") == workload and r.get("device") == device_type:
            latest.pop((r["rung"], r["batch_size"]), None)
            latest[(r["rung"], r["batch_size"])] = r
    # plain first, then as measured (the sweep measures the fp32 reference before plain).
    order = list(dict.fromkeys(["plain", *(r["rung"] for r in records)]))
    return sorted(latest.values(), key=lambda r: (order.index(r["rung"]), r["batch_size"]))


def report_results(out: Path, workload: str, device_type: str, file=None) -> Path | None:
    """Table and chart from ``out/results.jsonl`` alone; returns the chart's path (None when
    nothing was measured)."""
    records = latest_runs(read_results(out), workload, device_type)
    if not records:
        raise FileNotFoundError(f"no {workload} runs on {device_type} in {out}")
    env = records[0].get("env", {})
    title = (f"{workload} on {env.get('device_name', device_type)} (torch {env.get('torch')}, "
             f"{data_label(records)}, latest run of each rung and batch size)")
    print_ladder(records, title=title, file=file)
    if any(median_rate(r) for r in records):
        return plot_ladder(records, Path(out) / "ladder.png", title)
    return None
