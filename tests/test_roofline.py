"""Each kernel class's distance to its limit (``kasoku.perf.profile.work``, ``roofline``) and
the verdict that reads it, on a real GPU trace recorded with shapes: nanoGPT's GPT-2 small
step (batch 16 x 1,024, bf16 autocast, compiled, fused AdamW), three steps on one H200."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from kasoku.accel.config import AccelConfig
from kasoku.advisor.limits import unjudged_ms
from kasoku.advisor.verdict import judge
from kasoku.perf.profile import roofline, trace, work
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.profile.kernels import kernel_class

TRACE = Path(__file__).parent / "fixtures" / "traces" / "h200-nanogpt-b16-shapes.json.gz"
STEPS, B, T, L, D, V = 3, 16, 1024, 12, 768, 50304
ROOFS = roofline.Roofs({"bf16": 790e12}, 4.2e12)
"""About what one H200 measures (the matmul peak in bf16, the copy bandwidth)."""


@pytest.fixture(scope="module")
def events():
    return trace.read_events(TRACE)


@pytest.fixture(scope="module")
def by_class_ms(events):
    ms = collections.defaultdict(float)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            ms[kernel_class(e["name"])] += e["dur"] / 1e3 / STEPS
    return dict(ms)


def test_the_math_is_counted_as_the_papers_count_it(events):
    w = work.class_work(events, STEPS)
    tokens = B * T
    # 6 N per token for the weights' products: N the parameters multiplied (the tied head
    # counted once; position embeddings and the layer norms' weights not multiplied).
    n = (V * D + L * (4 * D * D + 8 * D * D))
    assert w["matmul/conv"].flop == pytest.approx(6 * n * tokens, rel=0.005)
    # Attention under a causal mask: 2 B T^2 d per layer forward, 2.5 times that backward.
    assert w["attention"].flop == pytest.approx(3.5 * 2 * B * T * T * D * L, rel=1e-6)
    assert set(w["matmul/conv"].flop_by_dtype) == {"bf16"}
    # Every kernel of the math and the element-wise chains has an operator with shapes;
    # the fused AdamW's tensor lists have none.
    for cls in ("matmul/conv", "attention", "norm/element-wise", "loss/softmax"):
        assert w[cls].unknown_us == 0.0
    assert w["optimizer"].known_us == 0.0 and w["optimizer"].unknown_us > 0


def test_the_classes_add_up_to_the_step_and_say_their_gaps(events, by_class_ms):
    w = work.class_work(events, STEPS)
    params = V * D + L * 12 * D * D
    table = roofline.roofline(by_class_ms, w, ROOFS, optimizer_bytes=params * 4 * 7)
    rows = {r["class"]: r for r in table["classes"]}
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(sum(by_class_ms.values()))
    mm = rows["matmul/conv"]
    # 12.15 TFLOP in 16.9 ms: ~720 TFLOP/s against a 790 roof; its time at the roof the
    # FLOPs' (the products are large: their bytes take less).
    assert 700 < mm["rate"] < 740 and mm["roof"] == pytest.approx(790)
    assert mm["roof_ms"] == pytest.approx(1e3 * mm["flop"] / 790e12)
    assert mm["gap_ms"] == pytest.approx(mm["ms"] - mm["roof_ms"])
    att = rows["attention"]
    assert att["rate"] < 300 and att["gap_ms"] > 2.5  # a third of the peak: the largest gap
    assert roofline.largest_gap(table)["class"] == "attention"
    ew = rows["norm/element-wise"]
    assert ew["unit"] == "GB/s" and 2000 < ew["rate"] < 4200
    assert rows["optimizer"]["gap_ms"] is not None  # its bytes given by the caller
    assert table["gap_ms"] == pytest.approx(sum(r["gap_ms"] or 0 for r in rows.values()))
    step_ms = sum(by_class_ms.values()) + 0.5
    printed = roofline.table_rows(table, step_ms)
    assert printed[-1][0] == "idle (no kernel)" and printed[-1][1] == "0.50"
    assert sum(float(r[1]) for r in printed) == pytest.approx(step_ms, abs=0.01 * len(printed))


def test_without_the_update_s_bytes_the_optimizer_has_no_gap(events, by_class_ms):
    table = roofline.roofline(by_class_ms, work.class_work(events, STEPS), ROOFS)
    opt = next(r for r in table["classes"] if r["class"] == "optimizer")
    assert opt["gap_ms"] is None and opt["rate"] is None
    assert opt["ms"] <= table["unknown_ms"] < opt["ms"] + 0.01  # and a copy or two
    printed = {r[0]: r for r in roofline.table_rows(table, 40.0)}
    assert printed["optimizer"][3] == "unknown" and printed["optimizer"][7] == "-"


def test_the_input_pipelines_kernels_are_shown_not_judged(events, by_class_ms):
    # A GPU loader's decoding (nvJPEG) beside the step: a row of its own, no rate, no gap,
    # and not counted as the model's work the verdict could not judge.
    w = work.class_work(events, STEPS)
    table = roofline.roofline({**by_class_ms, "input": 5.75}, w, ROOFS)
    row = next(r for r in table["classes"] if r["class"] == "input")
    assert row["ms"] == 5.75 and row["rate"] is None and row["gap_ms"] is None
    assert unjudged_ms(table) == pytest.approx(unjudged_ms(roofline.roofline(by_class_ms, w,
                                                                             ROOFS)))
    assert table["unknown_ms"] >= 5.75
    printed = {r[0]: r for r in roofline.table_rows(table, sum(by_class_ms.values()) + 5.75)}
    assert printed["input"][3] == "not judged" and printed["input"][7] == "-"
    # A device-bound verdict names them where they take 5% of the step or more.
    step_ms = sum(by_class_ms.values()) + 5.75
    v = judge(_figures(table, step_ms), AccelConfig(precision="bf16", compile=True,
                                                    cuda_graph=True))
    assert "beside them, the loader's own kernels (decoding, crops) take 5.75 ms" in v.reason
    small = roofline.roofline({**by_class_ms, "input": 0.5}, w, ROOFS)
    v = judge(_figures(small, step_ms), AccelConfig(precision="bf16", compile=True,
                                                    cuda_graph=True))
    assert "loader's own kernels" not in v.reason


def _figures(table: dict, step_ms: float) -> StepFigures:
    device_ms = sum(r["ms"] for r in table["classes"])
    return StepFigures.from_dict({
        "device": "cuda", "step_ms": step_ms, "busy_pct": 100 * device_ms / step_ms,
        "device_ms": device_ms, "idle_data_pct": 0.0, "idle_host_pct": 0.0,
        "idle_other_pct": 0.0, "data_pct": 0.0, "host_ms": 5.0, "kernels_per_step": 500,
        "launches_per_step": 1, "by_kind_ms": {"conv/matmul": 17.0},
        "by_kind_pct": {"conv/matmul": 60.0}, "roofline": table, "mfu": 0.45,
        "has_conv": False})


def test_the_verdict_names_the_class_with_most_to_gain(events, by_class_ms):
    table = roofline.roofline(by_class_ms, work.class_work(events, STEPS), ROOFS)
    f = _figures(table, sum(by_class_ms.values()) + 0.3)
    v = judge(f, AccelConfig(precision="bf16", compile=True, cuda_graph=True))
    assert v.rule == "device-bound (compute-bound)"
    assert "above the kernels' measured limits, most in attention" in v.reason
    fallback = v.lever if not v.candidates else None
    # The top rung's levers are set: nothing to measure, the fallback speaks.
    assert fallback is not None and "no cheap lever left" not in fallback.text
    assert fallback.text.startswith("the time above the limits is most in attention")
    assert "--sdpa-backend" in fallback.text


def test_no_cheap_lever_left_only_under_a_tenth_of_the_step():
    table = {"classes": [
        {"class": "matmul/conv", "ms": 30.0, "known_pct": 100.0, "flop": 1.0, "bytes": 0.0,
         "unit": "TFLOP/s", "rate": 700.0, "roof": 790.0, "roof_ms": 27.5, "gap_ms": 2.5},
        {"class": "norm/element-wise", "ms": 5.0, "known_pct": 100.0, "flop": 0.0,
         "bytes": 1.0, "unit": "GB/s", "rate": 3500.0, "roof": 4200.0, "roof_ms": 4.2,
         "gap_ms": 0.8}], "gap_ms": 3.3, "unknown_ms": 0.0, "roofs": ROOFS.to_dict()}
    accel = AccelConfig(precision="bf16", compile=True, cuda_graph=True)
    v = judge(_figures(table, 35.5), accel)
    assert v.lever.text.startswith("no cheap lever left: every kernel class is near its")
    assert "3.30 ms, 9% of the step" in v.lever.text
    wider = {**table, "gap_ms": 4.0,
             "classes": [table["classes"][0], {**table["classes"][1], "gap_ms": 1.5}]}
    v = judge(_figures(wider, 35.5), accel)
    assert v.lever.text.startswith("the time above the limits is most in matmul/conv")
    # most kernels' work unknown (CUDA graphs' replays): no distance said, no "near its limit"
    graphed = {**table, "gap_ms": 0.8, "unknown_ms": 30.0,
               "classes": [{**table["classes"][0], "known_pct": 0.0, "rate": None,
                            "roof": None, "roof_ms": None, "gap_ms": None},
                           table["classes"][1]]}
    v = judge(_figures(graphed, 35.5), accel)
    assert "near its" not in v.lever.text and "above the limits" not in v.lever.text
    assert "30.00 ms of kernels is unknown" in v.reason
    # a collective's time is not judged against a roof: it is no kernel of unknown work
    comm = {**table, "unknown_ms": 30.0, "classes": [
        *table["classes"], {"class": "communication", "ms": 30.0, "known_pct": 0.0,
                            "rate": None, "roof": None, "roof_ms": None, "gap_ms": None}]}
    v = judge(_figures(comm, 65.5), accel)
    assert "unknown" not in v.reason


@pytest.mark.parametrize("name, args, flop", [
    ("aten::mm", {"Input Dims": [[64, 32], [32, 16]]}, 2 * 64 * 32 * 16),
    ("aten::addmm", {"Input Dims": [[16], [64, 32], [32, 16]]}, 2 * 64 * 32 * 16),
    ("aten::bmm", {"Input Dims": [[4, 64, 32], [4, 32, 16]]}, 2 * 4 * 64 * 32 * 16),
    # ResNet's stem: 7x7, stride 2, padding 3 on 224x224: a 112x112 output
    ("aten::convolution", {"Input Dims": [[8, 3, 224, 224], [64, 3, 7, 7], [], [], [], []],
                           "Concrete Inputs": ["", "", "", "[2, 2]", "[3, 3]", "[1, 1]"]},
     2 * 8 * 64 * 3 * 49 * 112 * 112),
    ("aten::convolution_backward", {"Input Dims": [[8, 64, 112, 112], [8, 3, 224, 224],
                                                   [64, 3, 7, 7]]},
     2 * 2 * 8 * 64 * 3 * 49 * 112 * 112),
    ("aten::_flash_attention_forward",
     {"Input Dims": [[2, 128, 4, 64], [2, 128, 4, 64], [2, 128, 4, 64]],
      "Concrete Inputs": ["", "", "", "", "", "128", "128", "0.", "False"]},
     4 * 2 * 4 * 128 * 128 * 64),
    ("aten::add", {"Input Dims": [[10, 10], [10, 10]]}, 0),
])
def test_flops_from_shapes(name, args, flop):
    assert work.op_flop(name, args) == flop


@pytest.mark.parametrize("name, args, nbytes", [
    ("aten::add", {"Input Dims": [[10, 10], [10, 10]], "Input type": ["float", "float"]}, 1200),
    ("aten::add_", {"Input Dims": [[10, 10], []], "Input type": ["c10::BFloat16", "Scalar"]},
     400),
    ("aten::sum", {"Input Dims": [[10, 10], []], "Input type": ["float", "ScalarList"]}, 400),
    ("aten::fill_", {"Input Dims": [[10, 10], []], "Input type": ["float", "Scalar"]}, 400),
    ("aten::copy_", {"Input Dims": [[10, 10], [10, 10]],
                     "Input type": ["c10::BFloat16", "float"]}, 600),
    ("triton_poi_fused_gelu_0", {"Input Dims": [[10, 10], [10, 10], []],
                                 "Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"]},
     400),
    ("triton_poi_fused_gelu_0", {"kernel_num_gb": 0.5, "Input Dims": [[10]],
                                 "Input type": ["float"]}, 0.5e9),
])
def test_bytes_from_shapes(name, args, nbytes):
    assert work.op_bytes(name, args) == nbytes


def test_the_picture_is_drawn(events, by_class_ms, tmp_path):
    pytest.importorskip("matplotlib")
    table = roofline.roofline(by_class_ms, work.class_work(events, STEPS), ROOFS)
    path = roofline.draw(table, 32.0, tmp_path / "roofline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_levers_on_the_class_with_most_to_gain_are_measured_first(events, by_class_ms):
    table = roofline.roofline(by_class_ms, work.class_work(events, STEPS), ROOFS)
    f = _figures(table, sum(by_class_ms.values()) + 0.3).adding(has_blocks=True)
    v = judge(f, AccelConfig(precision="bf16", compile=True, cuda_graph=True))
    assert [c.args for c in v.candidates] == [("--sdpa-backend", "cudnn"),
                                              ("--sdpa-backend", "flash")]
    assert v.candidates[0].text.startswith("attention 3.2 ms above its limit")
    # The step ran cuDNN's attention already (PyTorch's pick on an H200): flash is left.
    cudnn = f.adding(top_kernels=[{"name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"
                                           "_wgmma_f16_knob_3_64x64x64", "ms_per_step": 1.5,
                                   "launches_per_step": 12}])
    v = judge(cudnn, AccelConfig(precision="bf16", compile=True, cuda_graph=True))
    assert [c.args for c in v.candidates] == [("--sdpa-backend", "flash")]
    # A script's figures (no workload's blocks known): kasoku sets none of these.
    assert judge(f.adding(has_blocks=None), AccelConfig(precision="bf16")).candidates == []


def test_streams_at_once_are_their_own_row():
    # ResNet-50's top rung on one H200: the weight gradients' convolutions on a second stream
    # put 38.3 ms of kernels into a 32.1 ms busy step.
    rows = [{"class": "matmul/conv", "ms": 15.66, "known_pct": 100.0, "flop": 8.31e12,
             "bytes": 1.0, "unit": "TFLOP/s", "rate": 531.0, "roof": 692.0, "roof_ms": 12.0,
             "gap_ms": 3.66},
            {"class": "norm/element-wise", "ms": 22.64, "known_pct": 100.0, "flop": 0.0,
             "bytes": 45e9, "unit": "GB/s", "rate": 2072.0, "roof": 4216.0, "roof_ms": 10.68,
             "gap_ms": 11.96}]
    table = {"classes": rows, "gap_ms": 15.62, "unknown_ms": 0.0, "busy_ms": 32.08,
             "roofs": ROOFS.to_dict()}
    printed = roofline.table_rows(table, 32.58)
    assert [r[0] for r in printed][-2:] == ["overlapped (streams at once)", "idle (no kernel)"]
    assert printed[-2][1] == "-6.22" and printed[-1][1] == "0.50"
    assert sum(float(r[1]) for r in printed) == pytest.approx(32.58, abs=0.02)


def test_where_no_lever_was_faster_the_class_is_still_named(events, by_class_ms):
    from kasoku.advisor.advice import Outcome, advise
    table = roofline.roofline(by_class_ms, work.class_work(events, STEPS), ROOFS)
    f = _figures(table, sum(by_class_ms.values()) + 0.3).adding(has_blocks=True)
    v = judge(f, AccelConfig(precision="bf16", compile=True, cuda_graph=True))
    flash = v.candidates[-1]
    v = advise(v, [Outcome(flash, base=[100.0, 101.0], rates=[100.5, 100.0])])
    assert v.lever.text.startswith("none of the levers tried was faster here (tried: "
                                   "--sdpa-backend flash 1.00x, within noise); the time above "
                                   "the limits is most in attention")
    assert type(v).from_dict(v.to_dict()).fallback.text == v.fallback.text  # as saved


def test_the_summary_and_the_report_show_the_table(tmp_path):
    """GPT-2 small's top rung as ``kasoku profile`` saved it on one H200: the printed table's
    rows and the report's are the classes, the idle rest and the step's time above the
    limits."""
    import json
    import re

    from kasoku.advisor.verdict import Verdict
    from kasoku.cli.profile import summary
    from kasoku.perf.profile.html import write_report
    saved = json.loads((Path(__file__).parent / "fixtures" / "verdicts"
                        / "h200-gpt-small-top-roofline.json").read_text())
    f = saved["figures"]
    text = summary({"phases": saved["phases"], "figures": f,
                    "verdict": Verdict.from_dict(saved["verdict"]), "out": str(tmp_path)})
    lines = text.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("time by kernel class against"))
    assert "6.63 ms of the 33.19 ms step above the limits" in lines[head]
    rows = lines[head + 2:head + 2 + len(f["roofline"]["classes"]) + 1]
    assert [r.split()[0] for r in rows] == [r["class"] for r in f["roofline"]["classes"]] + ["idle"]
    png = roofline.draw(f["roofline"], f["step_ms"], tmp_path / "roofline.png")
    page = write_report(tmp_path / "report.html", title="gpt", verdict=saved["verdict"],
                        figures=f, phases=saved["phases"], timeline_png=None, ladder=None,
                        settings={}, roofline_png=png).read_text()
    section = page[page.index("Time by kernel class, against its limit"):]
    table = re.search(r"<table>(.*?)</table>", section, re.S).group(1)
    assert table.count("<tr>") == 1 + len(f["roofline"]["classes"]) + 1  # header, idle
    assert 'id="roofline"' in section and "data:image/png;base64," in section


def test_a_graphs_kernels_under_one_operator_have_unknown_work(events):
    """A CUDA graph's replay (the model compiled with ``reduce-overhead``) launches the whole
    forward's kernels under one operator: the shapes of its call are not their work."""
    replay = {"cat": "cpu_op", "name": "replay", "args": {
        "External id": 7, "Input Dims": [[64, 3, 224, 224]], "Input type": ["float"]}}
    names = ["sm90_xmma_fprop_implicit_gemm_bf16", "triton_red_fused_native_batch_norm_0"]
    kernels = [{"cat": "kernel", "name": names[i % 2], "dur": 10.0, "args": {"External id": 7}}
               for i in range(work.GRAPH_KERNELS)]
    w = work.class_work([replay, *kernels])
    assert {c: (x.known_us, x.unknown_us, x.bytes) for c, x in w.items()} == {
        kernel_class(names[0]): (0.0, 80.0, 0.0), kernel_class(names[1]): (0.0, 80.0, 0.0)}
    # as many kernels of one class (a foreach update's): its operator's work, as before
    one = [{**k, "name": names[1]} for k in kernels]
    assert work.class_work([replay, *one])[kernel_class(names[1])].known_us == 160.0
