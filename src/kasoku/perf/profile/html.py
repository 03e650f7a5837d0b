"""``kasoku profile``'s report as one HTML file: the verdict, the figures behind it, the phases,
the top kernels and operators, the timeline picture and, after ``--confirm``, the ladder of
what was tried.

One file that opens anywhere, offline, years later: no external CSS, script or font, the
timeline PNG embedded as a base64 data URI, the styles in one ``<style>`` block. Every text
from the run (kernel names, settings, the verdict) is escaped with ``html.escape``.

The timeline ``<img>`` writes its decoded width into ``data-loaded`` when it loads, so a
headless browser's DOM dump can show that the embedded picture decodes.
"""
from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from kasoku.core.flags import flag
from kasoku.core.phases import PHASES
from kasoku.perf.profile import roofline
from kasoku.perf.profile.kfac_cost import format_kfac

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       color: #222; margin: 2em auto; max-width: 1200px; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.3em; }
h2 { font-size: 1.15em; margin: 1.6em 0 0.5em; border-bottom: 1px solid #ddd; }
#verdict { font-size: 1.2em; font-weight: 600; padding: 0.8em 1em; margin: 1em 0;
           border-left: 6px solid #d62728; background: #fdf3f3; }
#verdict.balanced { border-color: #2ca02c; background: #f2faf2; }
.secondary, .note { color: #666; font-size: 0.92em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #eee; text-align: left;
         vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.name { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 0.88em;
          max-width: 60em; word-break: break-all; }
.confirmed { color: #1a7f1a; font-weight: 600; }
.refuted { color: #c01818; font-weight: 600; }
img#timeline { max-width: 100%; border: 1px solid #ddd; }
pre { font-size: 12px; overflow-x: auto; background: #f7f7f7; padding: 0.5em; }
"""


def write_report(path, *, title: str, verdict: dict, figures: dict, phases: dict | None,
                 timeline_png: Path | None, ladder: list[dict] | None, settings: dict,
                 python_profile: Path | None = None, stability: dict | None = None,
                 roofline_png: Path | None = None) -> Path:
    """Write the report to ``path`` and return it as a ``Path``. ``verdict``:
    ``Verdict.to_dict()``; ``figures``: ``trace.analyse``'s dict plus the context keys
    (``mfu`` a fraction, ``mem_peak_gib``, ...); ``phases``: ``phases.summarize``'s dict
    (None: not timed); ``timeline_png``: embedded when given and present; ``ladder``: the
    rows of ``--confirm`` (``label``, ``samples_per_s``, ``ratio``, ``expected``,
    ``outcome``); ``settings``: shown as key/value pairs; ``python_profile``: pyinstrument's
    HTML page, linked, with its text form (the ``.txt`` beside it) shown; ``stability``: the
    unprofiled throughput's (``kasoku.perf.noise.Stability.to_dict``); ``roofline_png``: the
    picture of ``figures["roofline"]`` (``roofline.draw``), shown under its table."""
    parts = [f"<h1>{_esc(title)}</h1>", _verdict(verdict)]
    if verdict.get("tried"):
        parts += ["<h2>The levers tried</h2>", _tried(verdict["tried"])]
    if ladder:
        parts += [f"<h2>{flag('profile.confirm')}: the bound's proof, and the advice "
                  "again</h2>", _ladder(ladder)]
    parts += ["<h2>Figures</h2>", _table(["figure", "value"],
                                         _figure_rows(figures) + _noise_rows(stability))]
    parts += _timeline(timeline_png, figures.get("device") == "cpu")
    parts += _phase_tables(phases, figures)
    kinds = {k: v for k, v in (figures.get("by_kind_ms") or {}).items() if v > 0}
    if kinds:
        parts += ["<h2>Time by kind</h2>",
                  _table(["kind", "ms/step"], [(k, _num(v)) for k, v in kinds.items()])]
    classes = {k: v for k, v in (figures.get("by_class_ms") or {}).items() if v > 0}
    if figures.get("roofline"):
        parts += _roofline(figures["roofline"], figures["step_ms"], roofline_png)
    elif classes:
        parts += ["<h2>Time by kernel class</h2>",
                  _table(["class", "ms/step"], [(k, _num(v)) for k, v in classes.items()])]
    if figures.get("top_kernels"):
        parts += ["<h2>Top kernels</h2>",
                  _table(["kernel", "ms/step", "launches/step"],
                         [(k["name"], _num(k["ms_per_step"]), _num(k["launches_per_step"]))
                          for k in figures["top_kernels"]], name_col=0)]
    if figures.get("top_operators"):
        parts += ["<h2>Top operators (host self time)</h2>",
                  _table(["operator", "ms/step"],
                         [(o["name"], _num(o["ms_per_step"])) for o in figures["top_operators"]],
                         name_col=0)]
    if python_profile is not None:
        parts += _python(Path(python_profile), Path(path).parent)
    parts += ["<h2>Settings</h2>",
              _table(["setting", "value"], [(k, _value(v)) for k, v in settings.items()],
                     numbers=False)]
    page = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(parts) + "\n</body>\n</html>\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _python(page: Path, where: Path) -> list[str]:
    text = page.with_suffix(".txt")
    shown = text.read_text(encoding="utf-8") if text.exists() else ""
    href = page.name if page.parent == where else page.as_uri()
    return ["<h2>Host Python profile (pyinstrument)</h2>",
            f'<p><a href="{_esc(href)}">the interactive profile</a></p>',
            f"<pre>{_esc(shown)}</pre>"]


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _num(x, unit: str = "") -> str:
    """``x`` to about three significant digits (whole numbers from 100 up); "-" for None."""
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        text = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    else:
        text = str(x)
    return f"{text}{unit}"


def _value(v) -> str:
    """A setting as text: lists and dicts as JSON."""
    return json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else str(v)


def _table(headers: list[str], rows, name_col: int | None = None, numbers: bool = True) -> str:
    """A table of text cells (escaped here); ``numbers``: cells that hold a number (with its
    unit) right-aligned; ``name_col``: the column of (long, monospaced) names."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = "name" if i == name_col else "num" if numbers and _numeric(cell) else ""
            cells.append(f"<td class=\"{cls}\">{_esc(cell)}</td>" if cls else
                         f"<td>{_esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>\n<tr>{head}</tr>\n" + "\n".join(body) + "\n</table>"


_NUMBER = re.compile(r"^(x?-?[\d,]*\.?\d+(e[+-]?\d+)?( ?(%|ms|GiB))?|-)$")


def _numeric(cell) -> bool:
    """Whether ``cell`` is a number as ``_num`` writes it, with its unit (or "-": none)."""
    return bool(_NUMBER.match(str(cell)))


def _verdict(v: dict) -> str:
    cls = " class=\"balanced\"" if v.get("rule") == "balanced" else ""
    out = [f"<div id=\"verdict\"{cls}>{_esc(v.get('line', ''))}</div>"]
    if v.get("secondary"):
        out.append(f"<p class=\"secondary\">also: {_esc('; '.join(v['secondary']))}</p>")
    edits = [e["text"] for e in v.get("edits") or [] if e["text"] != v["lever"]["text"]]
    if edits:  # a script's levers that need it edited (kasoku.commands.script_levers)
        out.append(f"<p class=\"secondary\">also, each an edit to the script (not measured): "
                   f"{_esc('; '.join(edits))}</p>")
    if v.get("unconfirmed"):
        out.append(f"<p class=\"secondary\">not confirmed (each needs an edit to the script): "
                   f"{_esc('; '.join(v['unconfirmed']))}</p>")
    return "\n".join(out)


def _figure_rows(f: dict) -> list[tuple[str, str]]:
    """The main figures present in ``f``, as (label, value) rows."""
    rows = []

    def add(label: str, key: str, unit: str = "", scale: float = 1.0) -> None:
        if f.get(key) is not None:
            rows.append((label, _num(scale * f[key], unit)))

    add("step (unprofiled)", "step_ms", " ms")
    if (f.get("profiled") or {}).get("step_ms"):
        rows.append(("step (profiled)", _num(f["profiled"]["step_ms"], " ms")))
    add("samples/s (unprofiled)", "unprofiled_samples_per_s")
    add("samples/s (profiled)", "samples_per_s")
    add("samples per step", "samples_per_step")
    add("device busy", "busy_pct", "%")
    add("device idle: waiting for data", "idle_data_pct", "%")
    add("device idle: waiting for the host to launch", "idle_host_pct", "%")
    add("device idle: other (dependencies, syncs)", "idle_other_pct", "%")
    if f.get("comm_pct"):  # one process has none to show
        add("collectives", "comm_pct", "%")
    add("host busy per profiled step", "host_ms", " ms")
    add("host blocked in syncs per step", "host_blocked_ms", " ms")
    add("host in the loader per step", "host_data_ms", " ms")
    add("device busy per step", "device_ms", " ms")
    add("launches per step", "launches_per_step")
    add("kernels per step", "kernels_per_step")
    add("graph replays per step", "graph_replays_per_step")
    if f.get("device") == "cpu":
        add("waiting for data", "data_pct", "%")
        add("inside operators", "operator_pct", "%")
        add("operators per step", "ops_per_step")
    add("MFU", "mfu", "%", 100.0)
    add(f"fraction of the CPU's measured {f.get('peak_dtype', 'fp32')} peak", "peak_fraction",
        "%", 100.0)
    if f.get("peak_theory_text"):
        rows.append(("first-principles peak", str(f["peak_theory_text"])))
    if f.get("mfu") is None and f.get("peak_fraction") is None and f.get("mfu_note"):
        rows.append(("MFU", str(f["mfu_note"])))
    add("peak memory", "mem_peak_gib", " GiB")
    add("recompilations", "recompiles")
    add("profiled steps", "steps")
    return rows


def _noise_rows(stability: dict | None) -> list[tuple[str, str]]:
    if not stability:
        return []
    rows = [("samples/s (unprofiled): windows", f"{_num(stability['min'])} to "
             f"{_num(stability['max'])} over {stability['n']} windows")]
    for reason in stability.get("reasons") or []:
        rows.append(("unstable", reason))
    return rows


def _tried(tried: list[dict]) -> str:
    """The candidate levers as measured beside the run as given, fastest first."""
    rows = [(" ".join(t["args"]), f"x{t['ratio']:.2f}" if t.get("ratio") else "-",
             f"{100 * t['noise']:.0f}%" if t.get("noise") is not None else "-",
             t.get("result", ""), t.get("caveat") or "") for t in tried]
    return _table(["lever", "ratio (median)", "noise", "result", "note"], rows)


def _phase_tables(phases: dict | None, f: dict) -> list[str]:
    """The phases timed on every step (``phases``) with K-FAC's share (``f["kfac"]``), and
    those of the profiled window."""
    out = []
    if phases and "time/step" in phases:
        rows = [(p, _num(phases[f"time/{p}"]), _num(phases.get(f"time/{p}%"), "%"))
                for p in PHASES if f"time/{p}" in phases]
        rows.append(("step", _num(phases["time/step"]), "100%"))
        out += ["<h2>Phases (timed without the profiler)</h2>",
                _table(["phase", "ms/step", "of the step"], rows)]
        if f.get("kfac"):
            out.append(f"<p class=\"note\" id=\"kfac\">{_esc(format_kfac(f['kfac']))}</p>")
    host, device = f.get("phases_host_ms") or {}, f.get("phases_device_ms") or {}
    if host or device:
        names = [p for p in PHASES if p in host or p in device]
        names += [p for p in {**host, **device} if p not in names]
        headers = ["phase", "host ms/step"] + (["device ms/step"] if device else [])
        rows = [(p, _num(host.get(p))) + ((_num(device.get(p)),) if device else ())
                for p in names]
        out += ["<h2>Phases in the profiled window</h2>", _table(headers, rows)]
    return out


def _roofline(table: dict, step_ms: float, png: Path | None) -> list[str]:
    roofs = table["roofs"]
    peaks = ", ".join(f"{dt} {v / 1e12:,.0f} TFLOP/s" for dt, v in roofs["flops_per_s"].items())
    parts = ["<h2>Time by kernel class, against its limit</h2>",
             f"<p class=\"note\">roofs measured on this machine: matmul peak {peaks}; "
             f"memory copy {roofs['bytes_per_s'] / 1e9:,.0f} GB/s. {table['gap_ms']:.2f} ms of "
             f"the {step_ms:.2f} ms step above the limits "
             f"({100 * table['gap_ms'] / step_ms:.0f}%).</p>",
             _table(roofline.HEADER, roofline.table_rows(table, step_ms))]
    if png is not None and Path(png).is_file():
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        parts.append(f"<img id=\"roofline\" alt=\"time per kernel class against its limit\" "
                     f"src=\"data:image/png;base64,{data}\">")
    return parts


def _timeline(png: Path | None, cpu: bool) -> list[str]:
    if png is None or not Path(png).is_file():
        return []
    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    rows = ("operators: the top-level operators by kind; white: Python and dispatch" if cpu
            else "device: each kernel or copy, coloured by the phase that launched it; "
            "white: idle")
    return ["<h2>Timeline</h2>",
            f"<p class=\"note\">host: kasoku's phase spans; {rows}.</p>",
            f"<img id=\"timeline\" alt=\"timeline of the profiled steps\" "
            f"onload=\"this.dataset.loaded=this.naturalWidth\" "
            f"src=\"data:image/png;base64,{data}\">"]


def _ladder(rows: list[dict]) -> str:
    """The ``--confirm`` rows; the outcome cell classed by its first word (confirmed,
    refuted)."""
    with_args = any(r.get("args") for r in rows)
    headers = ["run", *(["arguments"] if with_args else []), "samples/s", "ratio",
               "expected", "outcome", "proves"]
    body = []
    for r in rows:
        ratio = r.get("ratio")
        outcome = str(r.get("outcome") or "")
        word = outcome.split(" ")[0].rstrip(":")
        cells = [("", _esc(r.get("label", ""))),
                 *([("name", _esc(r.get("args") or ""))] if with_args else []),
                 ("num", _esc(_num(r.get("samples_per_s")))),
                 ("num", _esc(f"x{ratio:.2f}" if ratio is not None else "-")),
                 ("", _esc(r.get("expected") or "")),
                 (word if word in ("confirmed", "refuted") else "", _esc(outcome)),
                 ("", _esc(r.get("proves") or ""))]
        body.append("<tr>" + "".join(f"<td class=\"{c}\">{text}</td>" if c else
                                     f"<td>{text}</td>" for c, text in cells) + "</tr>")
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    return f"<table id=\"ladder\">\n<tr>{head}</tr>\n" + "\n".join(body) + "\n</table>"
