"""``kasoku bench`` end to end on the CPU, one sweep shared by the tests of this file: every
run in its own worker process, results.jsonl, the table, ladder.png, a simulated OOM, the
numerics guard failing a deliberately broken rung, and each run's bottleneck verdict. Compile
rungs are left out: compiling takes longer here than this whole file may."""
import contextlib
import io
import json

import pytest
from PIL import Image

from kasoku.cli import main
from kasoku.commands.bench.sweep import SweepResult
from kasoku.commands.bench.worker import DIVERGE_ENV, OOM_ENV
from kasoku.perf.cpuinfo import cpu_info

pytestmark = pytest.mark.slow  # one sweep of 12 worker processes, ~30 s on 2 cores

MLP_FLOPS_PER_SAMPLE = 2 * 1_794_000 * 2 + 2 * (1000 * 1000 + 1000 * 10)
"""784-1000-1000-10: forward and weight gradients 2*in*out per layer, input gradients for
all layers but the first."""
BROKEN = "precision=bf16"
"""A custom rung whose learning rate the worker's test hook multiplies by 1e4."""
BF16_UNITS = cpu_info().bf16_hardware
"""With bf16 units the CPU ladder's +channels_last builds on +bf16 and, channels_last dropped
for an MLP, equals it (skipped); without them it builds on +keep-memory, in fp32, and runs."""
MEASURED = ("plain", "fp32", "+bf16", BROKEN) + (() if BF16_UNITS else ("+channels_last",))
FAST = ["--device", "cpu", "--steps", "2", "--windows", "2", "--warmup", "1",
        "--numerics-steps", "4", "--threads", "1", "--peak-size", "128"]


def bench(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", *argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(OOM_ENV, "64")
        mp.setenv(DIVERGE_ENV, BROKEN)
        code, text = bench(["mnist-mlp", "--batch-size", "8,64", "--config", "fp32",
                            "--config", "+bf16", "--config", "+channels_last", "--config",
                            BROKEN, "--out", str(out), "--kernels", "2", *FAST])
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return code, text, records, out


def test_cpu_ladder_writes_the_documented_results(sweep):
    code, text, records, out = sweep
    assert "channels_last does not apply" in text
    assert ("rung +channels_last skipped: without channels_last it equals rung +bf16"
            in text) == BF16_UNITS
    assert {(r["rung"], r["batch_size"]) for r in records} == \
        {(rung, bs) for rung in MEASURED for bs in (8, 64)}
    assert len({r["sweep_id"] for r in records}) == 1
    for r in records:
        assert r["schema"] == "kasoku.bench/1" and r["workload"] == "mnist-mlp"
        assert r["device"] == "cpu" and r["wall_s"] > 0
        for key in ("kasoku_git", "torch", "cuda", "cudnn", "driver", "device_name",
                    "device_count", "cpu_count"):
            assert key in r["env"], key
        assert r["data"]["source"] == "synthetic on-device"
        assert r["config"]["kind"] == ("plain" if r["rung"] == "plain" else "kasoku")
        if r["batch_size"] == 64:
            continue
        assert r["status"] == "ok", r["error"]
        f = r["figures"]
        s = f["samples_per_s"]
        # 2 windows, and more where they disagreed (the noise rule)
        assert s["n"] == 2 + f["stability"]["extra_windows"]
        assert 0 < s["min"] <= s["median"] <= s["max"]
        assert f["step_time_ms"]["median"] > 0 and f["warmup_s"] > 0 and f["mem_peak_gib"] > 0
        assert f["model_flops_per_step"] == MLP_FLOPS_PER_SAMPLE * r["batch_size"]
        fp32 = ("plain", "fp32") if BF16_UNITS else ("plain", "fp32", "+channels_last")
        assert f["compute_dtype"] == ("fp32" if r["rung"] in fp32 else "bf16")
        assert f["peak"]["dtype"] == f["compute_dtype"] and f["peak_flops_per_s"] > 0
        assert "mfu" in f and (f["mfu"] is None or 0 < f["mfu"] <= 1) and f["mfu_note"]
        assert len(r["numerics"]["losses"]) == 4
    table = text[text.index("rung "):]
    for needle in ("bs 8", "bs 64", "plain", "fp32", "bf16", "OOM", "x1.00"):
        assert needle in table, needle
    # An MLP's samples are not images: the records, progress lines and table say samples/s.
    assert {r["unit"] for r in records} == {"samples"}
    assert "samples/s" in text and "images/s" not in text
    with Image.open(out / "ladder.png") as img:
        assert img.format == "PNG" and img.size[0] > 300


def test_each_run_records_where_its_step_time_goes(sweep):
    _, _, records, _ = sweep
    ok = [r for r in records if r["status"] == "ok"]
    assert ok
    for r in ok:
        k = r["figures"]["kernels"]
        assert k["steps"] == 2 and k["device"] == "cpu"
        split = k["by_category_ms_per_step"]
        # the MLP's three layers are matrix products; Adam's operators run in its step
        assert split["conv/matmul"] > 0 and split["optimizer"] > 0, (r["rung"], split)
        assert 0 < k["kernel_ms_per_step"] <= k["wall_ms_per_step"]
        assert any("addmm" in t["name"] or "mm" in t["name"] for t in k["top"])
    assert all("kernels" not in r["figures"] for r in records if r["status"] == "oom")


def test_each_run_records_its_bottleneck_and_the_table_shows_it(sweep):
    from kasoku.advisor.verdict import RULES
    from kasoku.commands.bench.report import short_rule
    _, text, records, _ = sweep
    # a verdict names its rule, with the rule's family first where it has one
    rules = ({r.name for r in RULES} | {"balanced"}
             | {f"{r.family} ({r.name})" for r in RULES if getattr(r, "family", "")})
    table = text[text.index("rung "):]
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    for r in records:
        if r["status"] != "ok":
            assert "verdict" not in r and "profile" not in r["figures"]
            continue
        p = r["figures"]["profile"]
        assert p["device"] == "cpu" and p["steps"] == 6 and p["step_ms"] > 0, p
        assert p["profiled"]["step_ms"] > 0 and p["batch_size"] == r["batch_size"]
        assert p["has_conv"] is False and "verdict" not in p
        assert 0 < len(p["top_operators"]) <= 5
        # kasoku's eager step takes the window's marks; the plain loop is one compute phase
        assert set(p["phases_host_ms"]) >= ({"data", "compute"} if r["rung"] == "plain"
                                            else {"data", "forward", "backward", "update"})
        v = r["verdict"]
        assert v["rule"] in rules and v["line"].startswith(v["rule"] + ": "), v
        assert short_rule(v["rule"]) in rows[r["rung"]], rows[r["rung"]]
    # under the table, each rung's verdict line at its largest judged batch size (8: 64 is OOM)
    for rung in ("plain", "fp32", "+bf16", BROKEN):
        rec = next(x for x in records if x["rung"] == rung and x["batch_size"] == 8)
        assert f"  {rung} (bs 8): {rec['verdict']['line']}" in table, table


def test_oom_is_recorded_and_the_other_sizes_measured(sweep):
    code, text, records, out = sweep
    for r in records:
        if r["batch_size"] == 64:
            assert r["status"] == "oom" and "simulated" in r["error"], r
            assert "samples_per_s" not in r["figures"]
        else:
            assert r["status"] == "ok"
    # An OOM is a result, not a failure: alone it leaves the exit code at 0.
    assert SweepResult([r for r in records if r["rung"] != BROKEN]).exit_code == 0


def test_numerics_guard_fails_the_broken_rung_and_the_exit_code(sweep):
    code, text, records, out = sweep
    assert code == 1
    by = {(r["rung"], r["batch_size"]): r for r in records}
    for bs in (8,):
        for rung in ("plain", "fp32", "+bf16"):
            assert by[(rung, bs)]["numerics"]["status"] == "ok", by[(rung, bs)]["numerics"]
        bad = by[(BROKEN, bs)]
        assert bad["status"] == "ok" and bad["numerics"]["status"] == "FAIL"  # runs, no training
        assert f"NUMERICS FAIL: {BROKEN} at bs {bs}" in text
    # plain and kasoku's fp32 step take the same steps.
    assert by[("plain", 8)]["numerics"]["rel_diff"] < 1e-4
    row = next(line for line in text.splitlines() if line.startswith(BROKEN + " "))
    assert "NUMERICS FAIL" in row and row.rstrip().endswith("FAIL")


def test_report_redraws_from_the_lines_alone(sweep):
    code, text, records, out = sweep
    (out / "ladder.png").unlink()
    code, again = bench(["mnist-mlp", "--device", "cpu", "--out", str(out), "--report"])
    assert code == 0 and "OOM" in again and "NUMERICS FAIL" in again
    assert (out / "ladder.png").exists()


def test_each_rung_of_a_long_ladder_has_its_own_color():
    from kasoku.commands.bench.report import rung_colors
    for n in (3, 10, 13, 20):
        colors = rung_colors(n)
        assert len(colors) == n and len(set(colors)) == n, n
