"""``kasoku compare``'s table, notes and chart, from ``kasoku.compare/1`` lines only, and the
side-by-side log table of its time-to-accuracy form."""
from __future__ import annotations

from pathlib import Path

from kasoku.commands.bench.compare import SCHEMA, times
from kasoku.commands.bench.results import read_results
from kasoku.commands.table import print_table
from kasoku.core.flags import flag
from kasoku.perf.noise import marked
from kasoku.train.extensions.plot_report import log_axis

SIDES = (("cpu", "CPU"), ("cuda", "1 GPU"), ("cuda_2", "2 GPUs"))


def duration(seconds: float | None) -> str:
    """``12.3 s``, ``45.2 min``, ``6.3 h``; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _rung(side: dict | None) -> str:
    if not side:
        return "-"
    if not side.get("samples_per_s"):
        return "none passed"
    return f"{side['rung']} (bs {side['batch_size']})"


def _share(side: dict | None) -> str:
    if not side or not side.get("samples_per_s"):
        return "-"
    if side.get("mfu") is None:
        return f"N/A {side.get('compute_dtype') or ''}".strip()
    return f"{100 * side['mfu']:.0f}% {side['compute_dtype']}"


def _rate(side: dict | None) -> str:
    if not side or not side.get("samples_per_s"):
        return "-"
    return marked(f"{side['samples_per_s']:,.0f}", side.get("stability"))


def _epoch(side: dict | None) -> str:
    if not side or side.get("epoch_s") is None:
        return "-"
    shortened = (side.get("window") or {}).get("shortened")
    return duration(side["epoch_s"]) + ("*" if shortened else "")


def table_rows(lines: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: a workload per row; a device's columns only where some line
    measured it (the 2-GPU ones where a ``kasoku scale`` result gave them), the ratios only
    where both the CPU and the GPU were measured."""
    has = {key: any(line.get(key) for line in lines) for key, _ in SIDES}
    headers = ["workload"]
    for key, name in SIDES[:2]:
        if has[key]:
            headers += [f"{name} best rung", f"{name} rate", f"{name} % peak", f"{name} epoch"]
    if has["cuda_2"]:
        headers += ["2 GPUs rate", "2 GPUs epoch"]
    both = has["cpu"] and has["cuda"]
    if both:
        headers += ["GPU/CPU", "peak ratio"]
    rows = []
    for line in lines:
        row = [line["workload"]]
        for key, _ in SIDES[:2]:
            if has[key]:
                side = line.get(key)
                row += [_rung(side), _rate(side), _share(side), _epoch(side)]
        if has["cuda_2"]:
            row += [_rate(line.get("cuda_2")), _epoch(line.get("cuda_2"))]
        if both:
            row += [times(line["speedup"]) if line.get("speedup") else "-",
                    times(line["peak_ratio"]) if line.get("peak_ratio") else "-"]
        rows.append(row)
    return headers, rows


def notes(lines: list[dict]) -> list[str]:
    """What the table's figures are: the extrapolations and their windows, the peaks (the
    CPU's first-principles peak beside the measured one), the 2-GPU column's source."""
    out = []
    windows = []
    for line in lines:
        for key in ("cpu", "cuda"):
            side = line.get(key)
            if not side or not side.get("samples_per_s"):
                continue
            w = side["window"]
            text = f"{line['workload']} {key} {w['windows']} x {w['steps']}"
            if w.get("shortened"):
                text += (f" (shortened*: an estimated {w['estimated_step_s']:.2g} s per step at "
                         f"an assumed {w['assumed_flops_per_s'] / 1e12:g} TFLOP/s)")
            windows.append(text)
    if windows:
        out.append("epoch times are extrapolated: the workload's training set (" + ", ".join(
            f"{line['workload']} {line['epoch_samples']:,}" if line.get("epoch_samples")
            else f"{line['workload']} unknown" for line in lines) + " samples) / the median "
            "rate of the timed windows on synthetic batches already on the device; timed "
            "steps per run: " + "; ".join(windows))
    peaks = []
    for line in lines:
        for key, name in (("cpu", "CPU"), ("cuda", "GPU")):
            side = line.get(key)
            if not side or not side.get("peak_flops_per_s"):
                continue
            text = (f"{line['workload']} {name} {side['compute_dtype']} "
                    f"{side['peak_flops_per_s'] / 1e12:.3g} TFLOP/s measured")
            if key == "cpu":
                theory = side.get("theoretical_peak_flops_per_s")
                text += (f", {theory / 1e12:.3g} first-principles (the measured is "
                         f"{100 * side['peak_flops_per_s'] / theory:.0f}% of it)" if theory
                         else ", no first-principles estimate for this CPU")
            peaks.append(text)
    if peaks:
        out.append("peaks (% peak is MFU: counted model FLOPs / the matmul peak measured in "
                   "the best rung's dtype): " + "; ".join(peaks))
    gpu2 = [line for line in lines if line.get("cuda_2")]
    if gpu2:
        out.append("2 GPUs: " + "; ".join(
            f"{line['workload']} {line['cuda_2']['rung']}, global batch "
            f"{line['cuda_2']['global_batch_size']}, from {line['cuda_2']['source']}"
            for line in gpu2))
    else:
        out.append(f"2 GPUs: not measured here; `kasoku scale WORKLOAD {flag('dist.gpus')} 1,2 "
                   f"{flag('scale.out')} DIR` measures data-parallel training and `kasoku compare "
                   f"... {flag('compare.scale')} DIR` adds its 2-GPU rates to this table")
    return out


def print_compare(lines: list[dict], file=None) -> None:
    """The table, a reading per workload, then the notes."""
    headers, rows = table_rows(lines)
    unit = lines[0].get("unit", "samples") if lines else "samples"
    print_table(headers, rows, file=file,
                title=f"kasoku compare: each device's best rung ({unit}/s, median of the "
                      f"timed windows, ! unstable); epoch = the real training set, "
                      f"extrapolated")
    for line in lines:
        print(f"{line['workload']}: {line['reading']}", file=file)
    for note in notes(lines):
        print(f"note: {note}", file=file)
    for line in lines:
        for key, name in SIDES:
            reasons = ((line.get(key) or {}).get("stability") or {}).get("reasons")
            if reasons:
                print(f"unstable (!): {line['workload']} on the {name}: {'; '.join(reasons)}",
                      file=file)


def latest_lines(out: Path, workloads: list[str]) -> list[dict]:
    """The latest throughput line of each of ``workloads`` (names as ``Workload.name``) in
    ``out/results.jsonl``, in the order given; workloads without one are left out."""
    latest = {r["workload"]: r for r in read_results(out)
              if r.get("schema") == SCHEMA and r.get("form") == "throughput"}
    return [latest[w] for w in workloads if w in latest]


def _device_label(key: str, name: str, lines: list[dict]) -> str:
    """``CPU: AMD EPYC (2 cores)``, ``1 GPU: NVIDIA H200``: the side's name and its device."""
    for line in lines:
        device = (line.get(key) or {}).get("device_name")
        if device:
            return f"{name}: {device}"
    return name


def plot_compare(lines: list[dict], path: Path) -> Path | None:
    """Seed 001's comparison as bars: per workload, the epoch time on the CPU, 1 GPU and 2
    GPUs (where measured), log scale; None when no epoch time is known."""
    plotted = [line for line in lines
               if any((line.get(k) or {}).get("epoch_s") for k, _ in SIDES)]
    if not plotted:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    sides = [(k, _device_label(k, n, plotted)) for k, n in SIDES
             if any((line.get(k) or {}).get("epoch_s") for line in plotted)]
    fig = Figure(figsize=(max(6.4, 1.8 * len(plotted) + 1.5), 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = min(0.4, 0.8 / len(sides))
    drawn, top = set(), max(line[k]["epoch_s"] for line in plotted for k, _ in SIDES
                            if (line.get(k) or {}).get("epoch_s"))
    for j, line in enumerate(plotted):
        # The bars a workload has, centred on its tick: one bar reads as well as three.
        here = [(i, key, name) for i, (key, name) in enumerate(sides)
                if (line.get(key) or {}).get("epoch_s")]
        for k, (i, key, name) in enumerate(here):
            side = line[key]
            x = j + width * (k - (len(here) - 1) / 2)
            bar, = ax.bar([x], [side["epoch_s"]], width, color=f"C{i}",
                          label=None if name in drawn else name)
            drawn.add(name)
            ax.text(x, side["epoch_s"], _epoch(side), ha="center", va="bottom", fontsize=7)
        if line.get("speedup"):  # above the group's tallest bar and its label
            high = max(line[k]["epoch_s"] for _, k, _ in here)
            ax.annotate(f"GPU x{line['speedup']:.0f}" if line["speedup"] >= 10
                        else f"GPU x{line['speedup']:.1f}", (j, high), xytext=(0, 14),
                        textcoords="offset points", ha="center", fontsize=8, weight="bold")
    ax.set_yscale("log")
    low, _ = ax.get_ylim()
    ax.set_ylim(low, top * 6)  # room for the labels above the tallest bar
    log_axis(ax)
    ax.set_xlim(-0.6, len(plotted) - 0.4)
    ax.set_xticks(range(len(plotted)), [line["workload"] for line in plotted], fontsize=8)
    ax.set_ylabel("seconds per epoch (extrapolated)")
    ax.set_title("one epoch on each device at its best rung (log scale; * a shortened timed "
                 "window; bold: the GPU's speed-up over the CPU)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


LOG_ENTRIES = ("main/loss", "validation/main/loss", "main/accuracy",
               "validation/main/accuracy", "elapsed_time")
"""Seed 001's log columns after the epoch."""


def side_by_side(logs: dict[str, list[dict]], entries=LOG_ENTRIES) -> list[str]:
    """Each device's log (LogReport entries) as seed 001's table, the devices side by side:
    one epoch column, then each device's columns under its name; blanks where a device has
    no such epoch or entry."""
    names = list(logs)
    widths = [max(10, len(e)) for e in entries]
    group = sum(widths) + 2 * (len(widths) - 1)
    epochs = sorted({e["epoch"] for log in logs.values() for e in log if "epoch" in e})
    by_epoch = {name: {e.get("epoch"): e for e in log} for name, log in logs.items()}
    sep = " | "
    top = "".ljust(10) + sep + sep.join(name.center(group) for name in names)
    head = "epoch".ljust(10) + sep + sep.join(
        "  ".join(e.ljust(w) for e, w in zip(entries, widths)) for _ in names)
    rows = [top.rstrip(), head.rstrip()]
    for epoch in epochs:
        cells = []
        for name in names:
            entry = by_epoch[name].get(epoch, {})
            cells.append("  ".join(" " * w if entry.get(e) is None else f"{entry[e]:<{w}g}"
                                   for e, w in zip(entries, widths)))
        rows.append((f"{epoch:<10g}" + sep + sep.join(cells)).rstrip())
    return rows


def totals_line(elapsed: dict[str, float]) -> str:
    """``total: cpu 131.9 s, cuda 34.8 s; cuda is 3.79x faster than cpu`` (the first device
    is the reference)."""
    text = "total: " + ", ".join(f"{name} {s:.1f} s" for name, s in elapsed.items())
    names = list(elapsed)
    if len(names) > 1 and elapsed[names[0]] > 0:
        base = elapsed[names[0]]
        text += "; " + ", ".join(
            f"{name} is {base / s:.2f}x as fast as {names[0]}" for name, s in
            list(elapsed.items())[1:] if s > 0)
    return text
