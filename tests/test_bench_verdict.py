"""The bottleneck verdict of ``kasoku bench`` in-process: the worker's profiled window (its
marks, a failure that leaves the rung measured), the sweep's judgement with the MFU, and the
table's bottleneck column and verdict lines. The end-to-end sweep is in test_bench_ladder."""
import io
import time

import pytest

from kasoku.advisor.saved import judge_saved
from kasoku.advisor.verdict import RULES
from kasoku.commands.bench import worker
from kasoku.commands.bench.report import bottleneck, print_ladder, verdict_lines
from kasoku.commands.bench.rungs import PLAIN, cpu_ladder
from kasoku.commands.bench.runner import make_runner
from kasoku.commands.bench.sweep import _add_verdict
from kasoku.core.phases import no_mark
from kasoku.perf.profile.window import Window
from kasoku.train.step import markable

FP32 = cpu_ladder()[1]


def _request(rung, **kw):
    args = dict(batch_size=8, steps=2, windows=2, warmup=1, numerics_steps=2, threads=1)
    args.update(kw)
    return worker.WorkerRequest("mnist-mlp", rung, **args)


@pytest.fixture(scope="module")
def fp32_run():
    return worker.run(_request(FP32))


@pytest.mark.parametrize("rung, phases", [(FP32, {"data", "forward", "backward", "update"}),
                                           (PLAIN, {"data", "compute"})])
def test_the_profiled_window_marks_the_step_and_gives_the_marks_back(rung, phases):
    import torch

    from kasoku.commands.bench.pool import batch_spec, make_pool
    from kasoku.workloads import create_workload
    wl = create_workload("mnist-mlp")
    model = wl.build_model()
    pool = make_pool(batch_spec(wl, model), 8, torch.device("cpu"), 2)
    runner = make_runner(rung, wl, model, torch.device("cpu"), wl.recipe.lr, [])

    def slow_loader(n, start):  # lazy, as a loader rung's: each batch is made when pulled
        for i in range(start, start + n):
            time.sleep(0.1)  # far above the step itself even on a busy 2-core machine
            yield pool[i % len(pool)]

    figures = worker.profile_window(runner, slow_loader, 0, torch.device("cpu"), 3,
                                    {"has_conv": False}, 8).to_dict()
    assert figures["steps"] == 3 and figures["samples_per_step"] == 8  # as many as asked
    assert set(figures["phases_host_ms"]) >= phases  # kasoku's eager step takes the marks
    assert figures["has_conv"] is False and "verdict" not in figures
    if rung is FP32:
        assert markable(runner.step).mark is no_mark  # it times nothing afterwards
    # the batch is pulled inside the data phase, so a slow loader reads as one
    assert figures["phases_host_ms"]["data"] >= 90
    assert judge_saved({**figures, "loader": "serial"}).rule == "input-bound"


def test_worker_records_the_profile_and_the_sweep_judges_it(fp32_run):
    rec = dict(fp32_run, figures=dict(fp32_run["figures"]))
    assert rec["status"] == "ok", rec["error"]
    p = rec["figures"]["profile"]
    # the shares of the step are restated for the unprofiled step (the windows' median)
    assert p["step_ms"] == pytest.approx(rec["figures"]["step_time_ms"]["median"])
    assert p["profiled"]["step_ms"] > 0 and p["cpu_bf16"] in (True, False)
    rec["figures"]["mfu"] = 0.25  # what _add_mfu leaves in the parent
    _add_verdict(rec, FP32)
    v = rec["verdict"]
    assert v["rule"] in {r.name for r in RULES} and v["lever"]["text"]
    if v["rule"] == "compute-bound":  # the CPU rule quotes the fraction of the fp32 peak
        assert "25% of its measured fp32 peak" in v["reason"]


def test_a_failing_profile_is_recorded_and_the_rung_still_measured(monkeypatch):
    def broken(self, *a, **k):
        raise RuntimeError("trace unreadable")
    monkeypatch.setattr(Window, "analyse", broken)
    rec = worker.run(_request(PLAIN))
    assert rec["status"] == "ok" and rec["error"] is None
    assert rec["figures"]["samples_per_s"]["median"] > 0
    assert rec["figures"]["profile"] == {"error": "RuntimeError: trace unreadable"}
    _add_verdict(rec, PLAIN)
    assert "verdict" not in rec
    assert verdict_lines([rec]) == ["plain (bs 8): no verdict: RuntimeError: trace unreadable"]


def test_no_profile_steps_no_profile():
    rec = worker.run(_request(PLAIN, profile_steps=0, windows=1, numerics_steps=0))
    assert rec["status"] == "ok" and "profile" not in rec["figures"]
    _add_verdict(rec, PLAIN)
    assert "verdict" not in rec


def _record(rung, bs, rule, status="ok"):
    rec = {"rung": rung, "batch_size": bs, "status": status, "unit": "samples",
           "numerics": {"status": "ok"},
           "figures": {"samples_per_s": {"median": 100.0 * bs, "min": 1, "max": 1}}}
    if rule:
        rec["verdict"] = {"rule": rule, "line": f"{rule}: because {rung} at {bs}"}
    return rec


def test_bottleneck_column_and_verdict_lines():
    assert bottleneck([_record("a", 8, "compute-bound"), _record("a", 16, "compute-bound")]) \
        == "compute-bound"
    assert bottleneck([_record("a", 8, "host-bound"), _record("a", 16, "host-bound"),
                       _record("a", 32, "compute-bound")]) \
        == "host-bound (8, 16) / compute-bound (32)"
    assert bottleneck([_record("a", 8, None), _record("a", 16, None, "oom")]) == "-"
    # the column leaves out a rule's family; the line under the table keeps it
    assert bottleneck([_record("a", 8, "host-bound"),
                       _record("a", 16, "device-bound (memory-bound)")]) \
        == "host-bound (8) / memory-bound (16)"
    records = [_record("plain", 8, "host-bound"), _record("plain", 16, "host-bound"),
               _record("plain", 32, "compute-bound"), _record("fast", 8, "compute-bound"),
               _record("fast", 32, None, "oom")]
    out = io.StringIO()
    print_ladder(records, title="t", file=out)
    text = out.getvalue().splitlines()
    assert text[1].split() == ["rung", "bs", "8", "bs", "16", "bs", "32", "bottleneck",
                               "numerics"]
    assert text[2].endswith("host-bound (8, 16) / compute-bound (32)  ok")
    assert text[3].split()[-2:] == ["compute-bound", "ok"] and "OOM" in text[3]
    assert text[4:] == ["bottleneck verdicts (a profiled window of each run):",
                        "  plain (bs 16): host-bound: because plain at 16",
                        "  plain (bs 32): compute-bound: because plain at 32",
                        "  fast (bs 8): compute-bound: because fast at 8"]
