"""The profile's pictures and report, from traces built here (no profiler, no GPU): the timeline
is a real PNG with something drawn, a graph-replayed kernel takes its phase by name, the
report is one offline HTML file that holds the verdict, the tables and the embedded picture,
and a headless browser (where one is installed) shows the verdict, the ladder and a decoded
picture."""
import re
import shutil
import subprocess

import numpy as np
import pytest

from kasoku.advisor.saved import judge_saved
from kasoku.perf.profile import trace
from kasoku.perf.profile.html import write_report
from kasoku.perf.profile.timeline import device_phases, draw_timeline, window

STEP_PHASES = [("data", 2000), ("h2d", 200), ("forward", 3000), ("backward", 5000),
               ("update", 1000)]
KERNELS_PER_PHASE = {"h2d": 1, "forward": 60, "backward": 120, "update": 20}


def phase_event(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"kasoku/{name}", "ts": ts,
            "dur": dur, "tid": 1}


def gpu_events(steps=4):
    """``steps`` steps whose phases launch kernels evenly through their span; the device runs
    each kernel 30 us after its launch or after the previous one (it lags the host)."""
    events, t, corr, device_free = [], 1000.0, 0, 0.0
    for _ in range(steps):
        for name, dur in STEP_PHASES:
            events.append(phase_event(name, t, dur))
            n = KERNELS_PER_PHASE.get(name, 0)
            for i in range(n):
                corr += 1
                launch = t + dur * (i + 0.5) / n
                copy = name == "h2d"
                events.append({"ph": "X", "cat": "cuda_runtime", "tid": 1,
                               "name": "cudaMemcpyAsync" if copy else "cudaLaunchKernel",
                               "ts": launch, "dur": 4, "args": {"correlation": corr}})
                start = max(launch + 30, device_free)
                kdur = 150 if copy else 10 + 20 * (corr % 3)
                events.append({"ph": "X", "cat": "gpu_memcpy" if copy else "kernel",
                               "name": "Memcpy HtoD" if copy else f"gemm_{name}_{corr % 5}",
                               "ts": start, "dur": kdur, "tid": 7,
                               "args": {"correlation": corr}})
                device_free = start + kdur
            t += dur
    return events


def cpu_events(steps=4):
    """Phases of ``steps`` steps, each with a few operators (one nested) and gaps."""
    events, t = [], 1000.0
    for _ in range(steps):
        for name, dur in STEP_PHASES:
            events.append(phase_event(name, t, dur))
            if name in ("forward", "backward", "update"):
                for i in range(4):
                    a = t + dur * i / 4
                    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::addmm",
                                   "ts": a, "dur": dur / 8, "tid": 1})
                    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_",
                                   "ts": a + 1, "dur": dur / 16, "tid": 1})
            t += dur
    return events


def assert_png_with_a_picture(path):
    import matplotlib.image
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    height, width = pixels.shape[:2]
    assert width > 800 and height > 150
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 5


def test_a_gpu_timeline_is_a_png_of_the_steps_after_the_first(tmp_path):
    t = trace.parse(gpu_events())
    w = window(t, steps=3)
    starts = trace.steps_of(t).starts
    assert (w.first, w.start, w.boundaries[:3]) == (1, starts[1], starts[1:4])
    assert w.end >= max(d.end for d in t.device if d.start < w.boundaries[-1])
    out = draw_timeline(t, tmp_path / "pics" / "timeline.png", title="gpu")
    assert out == tmp_path / "pics" / "timeline.png"
    assert_png_with_a_picture(out)


def test_a_cpu_timeline_has_host_and_operator_rows(tmp_path):
    t = trace.parse(cpu_events(steps=2))
    assert window(t, steps=3).first == 0  # fewer steps than asked: all of them
    assert_png_with_a_picture(draw_timeline(t, tmp_path / "cpu.png"))


def test_kernels_take_the_phase_that_launched_them_graph_replays_by_name():
    events = gpu_events(steps=2)
    t0 = 20000.0
    events += [phase_event("data", t0, 100), phase_event("compute", t0 + 100, 500),
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0 + 150,
                "dur": 10, "args": {"correlation": 9999}}]
    for i, name in enumerate(["gemm_fwd", "gemm_dgrad", "multi_tensor_apply_adam"]):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t0 + 200 + 50 * i,
                       "dur": 40, "args": {"correlation": 9999}})
    t = trace.parse(events)
    phases = dict(zip((d.name for d in t.device), device_phases(t)))
    assert phases["Memcpy HtoD"] == "h2d" and phases["gemm_forward_1"] == "forward"
    assert phases["gemm_backward_2"] == "backward" and phases["gemm_update_0"] == "update"
    assert [phases[n] for n in ("gemm_fwd", "gemm_dgrad", "multi_tensor_apply_adam")] == \
        ["forward", "backward", "update"]


LADDER = [{"label": "as given", "samples_per_s": 1000.0, "ratio": 1.0, "expected": "",
           "outcome": ""},
          {"label": "capture the step as a CUDA graph", "args": "--cuda-graph",
           "samples_per_s": 1800.0, "ratio": 1.8, "expected": ">= 1.10x",
           "outcome": "confirmed"},
          {"label": "synthetic data on the device <x>", "samples_per_s": None, "ratio": None,
           "expected": "< 1.10x", "outcome": "not measured: boom"}]


def gpu_report(tmp_path):
    t = trace.parse(gpu_events())
    figures = trace.analyse(t, samples_per_step=64)
    figures.update(mfu=0.123, mem_peak_gib=3.5, device="cuda")
    verdict = judge_saved(figures).to_dict()
    phases = {"time/step": 11.2, "time/data": 2.0, "time/data%": 17.9, "time/forward": 3.0,
              "time/forward%": 26.8}
    png = draw_timeline(t, tmp_path / "timeline.png", title="gpu")
    path = write_report(tmp_path / "report.html", title="kasoku profile: <gpu>",
                        verdict=verdict, figures=figures, phases=phases, timeline_png=png,
                        ladder=LADDER, settings={"batch_size": 64, "loader": "serial",
                                                 "levers": ["a", "b"]})
    return path, verdict, figures


def test_the_report_is_one_offline_file_with_the_verdict_and_the_picture(tmp_path):
    path, verdict, figures = gpu_report(tmp_path)
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"url\(|@import|<script|<link", text, re.I)
    assert "http://" not in text and "https://" not in text
    assert re.search(r'id="verdict"[^>]*>' + re.escape(_escaped(verdict["line"])), text)
    assert re.search(r'<img id="timeline"[^>]*src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"',
                     text)
    assert "kasoku profile: &lt;gpu&gt;" in text and "<gpu>" not in text
    assert 'id="ladder"' in text and "synthetic data on the device &lt;x&gt;" in text
    assert ">12.3%<" in text and ">3.5 GiB<" in text  # MFU and peak memory
    assert ">64<" in text and "gemm_backward_" in text  # samples/step, a top kernel
    assert f">{figures['launches_per_step']:.3g}<" in text
    # the kernel time by class, each class with its ms per step
    assert "<h2>Time by kernel class</h2>" in text and ">matmul/conv<" in text
    assert f">{figures['by_class_ms']['matmul/conv']:.3g}<" in text


def test_a_report_without_picture_phases_or_ladder(tmp_path):
    t = trace.parse(cpu_events())
    figures = trace.analyse(t)
    verdict = judge_saved(figures).to_dict()
    path = write_report(tmp_path / "r.html", title="cpu", verdict=verdict, figures=figures,
                        phases=None, timeline_png=None, ladder=None, settings={})
    text = path.read_text(encoding="utf-8")
    assert _escaped(verdict["line"]) in text
    assert "<img" not in text and 'id="ladder"' not in text
    assert "aten::addmm" in text  # top operators


def _escaped(text):
    import html
    return html.escape(text, quote=True)


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser():
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"no headless browser on PATH (looked for {', '.join(BROWSERS)})")


def headless(exe, *args, tmp_path):
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--disable-extensions",
                           f"--user-data-dir={tmp_path / 'browser-profile'}", *args],
                          capture_output=True, text=True, timeout=60)


def test_a_browser_shows_the_verdict_the_ladder_and_the_picture(tmp_path):
    exe = browser()
    path, verdict, _ = gpu_report(tmp_path)
    proc = headless(exe, "--virtual-time-budget=5000", "--dump-dom", path.as_uri(),
                    tmp_path=tmp_path)
    dom = proc.stdout
    assert proc.returncode == 0 and "<html" in dom, proc.stderr[-2000:]
    assert re.search(r'id="verdict"[^>]*>' + re.escape(_escaped(verdict["line"])), dom)
    ladder = re.search(r'<table id="ladder">(.*?)</table>', dom, re.S).group(1)
    assert ladder.count("<tr>") == 1 + len(LADDER)
    assert "confirmed" in ladder and "x1.80" in ladder and "1,800" in ladder
    loaded = re.search(r'<img id="timeline"[^>]*data-loaded="(\d+)"', dom)
    assert loaded and int(loaded.group(1)) > 800, "the embedded PNG did not decode"


def test_the_printed_summary_names_the_kernel_classes(tmp_path):
    from kasoku.cli.profile import summary
    t = trace.parse(gpu_events())
    figures = trace.analyse(t, samples_per_step=64)
    verdict = judge_saved(figures)
    text = summary({"phases": {"time/step": 11.2, "time/data": 2.0, "time/data%": 17.9},
                    "figures": figures, "verdict": verdict, "out": str(tmp_path)})
    line = next(x for x in text.splitlines() if x.startswith("time by kernel class"))
    assert f"matmul/conv {figures['by_class_ms']['matmul/conv']:.2f}" in line
    assert all(f"{k} " in line for k, ms in figures["by_class_ms"].items() if ms > 0)


def test_the_profilers_cost_is_said_where_it_is_resolved_and_only_there():
    # The profiled step against the unprofiled one: a cost where it stands out of the
    # unprofiled windows' range, not resolved inside it, nor where the profiled step ran faster.
    from kasoku.perf.profile.figures import profiler_cost
    f = {"step_ms": 10.0, "profiled": {"step_ms": 12.4}}
    assert profiler_cost(f, [9_800, 10_000, 10_300], 100) == (
        "12.40 ms per profiled step against 10.00 unprofiled: the profiler's cost +24%")
    assert profiler_cost(f, [7_000, 10_000, 12_000], 100).endswith(
        "+24%, not resolved: inside the unprofiled windows' 8.33-14.29 ms (the machine's noise "
        "is larger)")
    assert profiler_cost({"step_ms": 10.0, "profiled": {"step_ms": 8.0}}, None, 100) == (
        "8.00 ms per profiled step against 10.00 unprofiled: the profiled steps ran faster, so "
        "the machine's pace changed between them; the profiler's cost is not resolved")
    assert profiler_cost({"step_ms": 10.0}, None, 100) is None
