"""``kasoku data bench``'s table and chart, made from its result lines only (so ``--report``
redraws them from ``OUT/data_bench.jsonl`` anywhere)."""
from __future__ import annotations

import json
from pathlib import Path

from kasoku.commands.table import print_table
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.perf.noise import marked, ranges_meet

RESULTS_FILE = "data_bench.jsonl"
CHART_FILE = "data_bench.png"


def unit(records: list[dict]) -> str:
    """What the records' samples are: ``images``, unless one of them says otherwise."""
    units = {r.get("unit", "images") for r in records}
    return units.pop() if len(units) == 1 else "samples"


def progress_line(record: dict) -> str:
    """One measurement as the line printed when it finishes."""
    if record["status"] != "ok":
        return f"ERROR: {record['error']}"
    f = record["figures"]
    r = f["images_per_s"]
    per = f"{unit([record])}/s"
    text = (f"{r['median']:,.0f} {per} (min {r['min']:,.0f}, max {r['max']:,.0f}), "
            f"{f['mb_per_s']:,.1f} MB/s, {f['cpu_cores']:.2f} cores busy, first batch "
            f"{f['first_batch_s']:.2f} s")
    if "margin" in f:
        text += (f"; fed {f['fed_images_per_s']['median']:,.0f} {per}, "
                 f"{verdict(f, record['device'])}")
    return text


def verdict(figures: dict, device_type: str) -> str:
    """The loader alone against the model on synthetic batches: keeps up, or who waits how
    much; ``~``, no claim, where the two rates' windows' ranges meet (the noise's)."""
    margin, a = figures["margin"], figures["images_per_s"]
    b = figures.get("model_synthetic_images_per_s") or {}
    if "min" in b and ranges_meet(a, b):
        return f"~x{margin:.1f}: within the noise of the model's rate"
    if margin >= 1:
        return f"x{margin:.1f}: keeps up"
    who = "the GPU" if device_type == "cuda" else "the model"
    return f"x{margin:.1f}: {who} waits {100 * (1 - margin):.0f}%"


def print_data_bench(records: list[dict], file=None) -> None:
    """One row per measurement: the loader alone, and against the model where there is one."""
    with_model = any("margin" in r["figures"] for r in records)
    per = f"{unit(records)}/s"
    headers = ["source", "loader", "batch", per, "min-max", "MB/s", "cores busy",
               "first batch"]
    if with_model:
        headers += ["vs model", f"fed {per}", "fed/synthetic"]
    rows = []
    for r in records:
        f = r["figures"]
        if r["status"] != "ok":
            rows.append([r["source_label"], r["loader"], str(r["batch_size"]), "error",
                         "(below)", *["-"] * (len(headers) - 5)])
            continue
        rate = f["images_per_s"]
        row = [r["source_label"], r["loader"], str(r["batch_size"]),
               marked(f"{rate['median']:,.0f}", f.get("stability")),
               f"{rate['min']:,.0f}-{rate['max']:,.0f}", f"{f['mb_per_s']:,.1f}",
               f"{f['cpu_cores']:.2f} ({f['cpu_percent']:.0f}%)", f"{f['first_batch_s']:.2f} s"]
        if with_model:
            row += ([verdict(f, r["device"]),
                     f"{f['fed_images_per_s']['median']:,.0f}",
                     f"{100 * f['fed_fraction']:.0f}%"] if "margin" in f else ["-"] * 3)
        rows.append(row)
    title = f"data bench on {records[0]['device']}" if records else "data bench"
    models = {r["batch_size"]: r for r in records
              if "model_synthetic_images_per_s" in r["figures"]}
    for bs, model in sorted(models.items()):
        title += (f"; {model['model']['workload']} on synthetic on-device batches of {bs}: "
                  f"{model['figures']['model_synthetic_images_per_s']['median']:,.0f} {per}")
    print_table(headers, rows, title=title + f"  [{per}: median of the windows, ! unstable]",
                file=file)
    for r in records:  # an error whole, under the table: a cell would cut it mid-sentence
        if r["status"] != "ok":
            print(f"error: {r['source_label']} {r['loader']} bs {r['batch_size']}: "
                  f"{r['error']}", file=file)
    for r in records:
        reasons = ((r.get("figures") or {}).get("stability") or {}).get("reasons")
        if r["status"] == "ok" and reasons:
            print(f"unstable (!): {r['source_label']} {r['loader']} bs {r['batch_size']}: "
                  f"{'; '.join(reasons)}", file=file)


def _processes(loader: str) -> tuple[str, int]:
    """Where a loader stands on the chart's x axis: ``multiprocess:N``, ``threads:N`` and
    ``gpu-jpeg-procs:N`` at N, the rest (serial, device, in-process GPU decoding) at 0."""
    name, _, count = loader.partition(":")
    counted = ("multiprocess", "threads", "gpu-jpeg-procs")
    return name, int(count) if count.isdigit() and name in counted else 0


def plot_data_bench(records: list[dict], path: Path) -> Path | None:
    """images/s against loader processes: a line per source through its multiprocess:N
    points, other loaders as labelled markers, min-max whiskers, and the model's synthetic
    rate as a dashed line. None when nothing was measured."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7.0, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sizes = sorted({r["batch_size"] for r in ok})
    # One series per source, and per batch size when several were measured.
    series = list(dict.fromkeys((r["source_label"], r["batch_size"]) for r in ok))
    several_sources = len({source for source, _ in series}) > 1
    for i, (source, bs) in enumerate(series):
        label = source if len(sizes) == 1 else f"{source}, batch {bs}"
        # A marker's own words: its loader, and its series where the colour alone would say it.
        which = ", ".join(([source] if several_sources else [])
                          + ([f"bs {bs}"] if len(sizes) > 1 else []))
        color = f"C{i % 10}"
        mine = [r for r in ok if (r["source_label"], r["batch_size"]) == (source, bs)]
        line = sorted((_processes(r["loader"])[1], r) for r in mine
                      if _processes(r["loader"])[0] == "multiprocess")
        if line:
            _points(ax, line, color, "o-", f"{label} multiprocess")
        for r in mine:
            name, x = _processes(r["loader"])
            if name != "multiprocess":
                _points(ax, [(x, r)], color, "s" if name == "serial" else "^", None)
                ax.annotate(r["loader"] + (f" ({which})" if which else ""),
                            (x, r["figures"]["images_per_s"]["median"]),
                            textcoords="offset points", xytext=(5, 4), fontsize=7, color=color)
    models = {r["batch_size"]: r for r in ok if "model_synthetic_images_per_s" in r["figures"]}
    for j, (bs, model) in enumerate(sorted(models.items())):
        rate = model["figures"]["model_synthetic_images_per_s"]["median"]
        which = "" if len(sizes) == 1 else f", batch {bs}"
        ax.axhline(rate, color="k", linestyle=("--", ":", "-.")[j % 3], linewidth=1,
                   label=f"{model['model']['workload']} on synthetic data{which}: "
                   f"{rate:,.0f}/s")
    env = ok[0].get("env", {})
    gpu = f" + {env.get('device_name')}" if env.get("device_type") == "cuda" else ""
    ax.set_xlabel("loader processes (multiprocess:N, threads:N, gpu-jpeg-procs:N at N; "
                  "in-process loaders at 0)")
    ax.set_ylabel(f"{unit(ok)}/s (median of windows)")
    batches = ", ".join(map(str, sizes))
    ax.set_title(f"Data loading on {env.get('cpu_name', '?')} ({env.get('cpu_count')} cores){gpu}, "
                 f"batch {batches}\nwhiskers: min-max of the timed windows", fontsize=9)
    ax.set_xticks(sorted({_processes(r["loader"])[1] for r in ok}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


def _points(ax, points, color, style, label) -> None:
    xs = [x for x, _ in points]
    rates = [r["figures"]["images_per_s"] for _, r in points]
    ys = [s["median"] for s in rates]
    err = [[y - s["min"] for y, s in zip(ys, rates)], [s["max"] - y for y, s in zip(ys, rates)]]
    ax.errorbar(xs, ys, yerr=err, fmt=style, color=color, capsize=2, label=label)


def read_data_bench(out: Path) -> list[dict]:
    """The latest record of each (source, loader, batch size, device) in
    ``out/data_bench.jsonl`` (or that file itself), in the order they were first measured."""
    path = Path(out)
    path = path / RESULTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{flag('data_bench.report')}: no {RESULTS_FILE} in {out}; run the bench "
                          "first")
    latest: dict = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                key = (r["source_label"], r["loader"], r["batch_size"], r["device"])
                latest[key] = r  # a key keeps its first place, with its latest record
    return list(latest.values())


def report_data_bench(out: Path, file=None) -> Path | None:
    """Table and chart from ``out/data_bench.jsonl`` alone; returns the chart's path."""
    records = read_data_bench(out)
    print_data_bench(records, file=file)
    return plot_data_bench(records, Path(out) / CHART_FILE)

