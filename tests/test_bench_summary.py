"""The README's first command, ``kasoku bench mnist-mlp``: a short CPU ladder at one batch size
by default (``--full``: the whole one), the title's window count as measured, and the closing
line of conclusion: the winning rung, its ratio over plain, inside or outside the noise, and a
busy machine said with what it does to the figures."""
from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from kasoku.cli import build_parser, main
from kasoku.commands.bench.rung_spec import SHORT_CPU_LADDER
from kasoku.commands.bench.rungs import cpu_ladder, default_ladder, gpu_ladder, ladder_or_specs
from kasoku.commands.bench.summary import busy, conclusion, windows_text
from kasoku.core.flags import flag
from kasoku.workloads.registry import default_batch_sizes

FULL = flag("bench.full")


def _record(rung, median, lo, hi, n=3, bs=100, others=None, cores=2, load=None,
            numerics="ok"):
    reasons = [] if (hi - lo) / median <= 0.10 else ["its windows range over ..."]
    if others is not None and others >= 0.25:
        reasons.append("other processes used ...")
    machine = {"others_cores": others, "cores": cores, "cpus": list(range(cores)),
               "load_avg": load}
    return {"rung": rung, "batch_size": bs, "status": "ok", "unit": "samples",
            "figures": {"samples_per_s": {"median": median, "min": lo, "max": hi, "n": n},
                        "stability": {"stable": not reasons, "reasons": reasons,
                                      "machine": machine}},
            "settings": {}, "numerics": {"status": numerics}}


# --- the default ladder and batch sizes ------------------------------------------------------

def test_the_cpu_default_is_the_short_ladder_and_full_is_the_whole_one():
    assert [r.label for r in default_ladder("cpu", full=False)] == list(SHORT_CPU_LADDER)
    assert default_ladder("cpu") == default_ladder("cpu", full=True) == cpu_ladder()
    assert ladder_or_specs("cpu", None, full=False) == default_ladder("cpu", full=False)
    # a GPU's ladder is the same either way
    assert default_ladder("cuda", full=False) == default_ladder("cuda") == gpu_ladder()
    # a rung of the whole ladder can still be named by its label
    assert [r.label for r in ladder_or_specs("cpu", ["+compile"], full=False)] == [
        "plain", "+compile"]


def test_the_cpu_default_batch_is_the_recipes_as_in_the_readmes_cpu_row():
    assert default_batch_sizes(100, "bench", "cpu") == (100,)
    assert default_batch_sizes(100, "bench", "cpu", full=True) == (12, 25, 100)
    assert default_batch_sizes(256, "bench", "cpu") == (100,)  # at most CPU_MAX_BATCH
    assert default_batch_sizes(100, "bench", "cuda", full=True) == \
        default_batch_sizes(100, "bench", "cuda") == (12, 25, 50, 100)


def _sweep_config(argv, tmp_path):
    from kasoku.cli.bench import sweep_config
    from kasoku.commands.device import resolve_device
    from kasoku.workloads import create_workload
    args = build_parser().parse_args(["bench", "mnist-mlp", "--device", "cpu", *argv])
    return sweep_config(args, create_workload("mnist-mlp"), resolve_device("cpu"), tmp_path)


def test_the_flag_picks_the_ladder_and_the_sizes(tmp_path):
    short = _sweep_config([], tmp_path)
    assert [r.label for r in short.rungs] == list(SHORT_CPU_LADDER)
    assert short.batch_sizes == (100,) and FULL in short.more
    full = _sweep_config([FULL], tmp_path)
    assert [r.label for r in full.rungs] == [r.label for r in cpu_ladder()]
    assert full.batch_sizes == (12, 25, 100) and full.more is None
    assert _sweep_config(["--config", "+fused"], tmp_path).more is None
    with pytest.raises(SystemExit):  # the whole ladder or rungs of one's own, not both
        build_parser().parse_args(["bench", "mnist-mlp", FULL, "--config", "+fused"])


# --- the title's windows and the closing line ------------------------------------------------

def test_the_title_counts_the_windows_measured():
    assert windows_text([_record("plain", 100, 99, 101, n=3)], 3) == "median of 3 windows"
    assert windows_text([_record("plain", 100, 99, 101, n=3),
                         _record("fp32", 100, 99, 101, n=9)], 3) == "median of 3-9 windows"
    assert windows_text([], 5) == "median of 5 windows"


def test_a_winner_outside_the_noise_is_said_with_its_ratio():
    records = [_record("plain", 9000, 8900, 9100), _record("fp32", 9050, 8950, 9150),
               _record("+fused", 11250, 11100, 11400)]
    line = conclusion(records, more="the whole CPU ladder: --full")
    assert line.startswith("conclusion: +fused wins at bs 100: 1.25x plain (11,250 against "
                           "9,000 samples/s), outside the noise"), line
    assert "inside" not in line and "busy" not in line and "rough" not in line
    assert line.endswith("the whole CPU ladder: --full") and "\n" not in line


def test_a_difference_inside_the_noise_is_no_win():
    records = [_record("plain", 9000, 8000, 9900), _record("+fused", 9400, 8800, 10000)]
    line = conclusion(records)
    assert "+fused measured fastest at bs 100, 1.04x plain (9,400 against 9,000 samples/s), " \
           "inside the noise" in line
    assert "no rung is shown faster than plain" in line and "wins" not in line
    assert "+fused and plain marked !" in line  # both ranges over 10% of their median


def test_plain_fastest_is_said():
    line = conclusion([_record("plain", 9000, 8900, 9100), _record("+fused", 8000, 7900, 8100)])
    assert "no rung beat plain at bs 100: the fastest, +fused, is 0.89x plain" in line
    assert "outside the noise" in line
    line = conclusion([_record("plain", 9000, 8900, 9100), _record("+fused", 8950, 8850, 9050)])
    assert "no rung beat plain at bs 100 (the fastest, +fused, 0.99x plain), inside the " \
           "noise" in line


def test_a_busy_machine_is_said_and_what_it_does_to_the_figures():
    records = [_record("plain", 5000, 4900, 5100, others=1.3, load=5.4),
               _record("+fused", 6500, 6400, 6600, others=0.1)]
    state = busy(records)
    assert state == {"runs": 1, "of": 2, "cores_taken": 1.3, "cores": 2, "load": 5.4}
    line = conclusion(records)
    # apart, but plain's run shared its cores: a lead, no win
    assert line.startswith("conclusion: +fused measured fastest at bs 100, 1.30x plain"), line
    assert "outside the noise of the windows" in line and "plain marked !" in line
    assert "not a result" in line and "wins" not in line
    assert "the machine was busy (other processes took up to 1.3 of the run's 2 cores in 1 of " \
           "2 runs, load 5.4)" in line
    assert "below a quiet machine's" in line and "measure again when it is quiet" in line
    assert busy([_record("plain", 5000, 4900, 5100, others=0.1)]) is None


def test_no_pair_to_compare_still_ends_with_a_line():
    line = conclusion([_record("+fused", 9000, 8900, 9100)])
    assert line.startswith("conclusion: no rung to compare with plain")
    # a rung that broke training is no winner
    line = conclusion([_record("plain", 9000, 8900, 9100),
                       _record("bad", 20000, 19900, 20100, numerics="FAIL"),
                       _record("+fused", 9900, 9800, 10000)])
    assert "+fused wins" in line


# --- the first command, run ------------------------------------------------------------------

@pytest.mark.slow  # the short ladder's 3 runs and the peak probe, each a process: ~20 s
def test_the_first_command_ends_with_its_conclusion(tmp_path):
    out = tmp_path / "bench"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["bench", "mnist-mlp", "--device", "cpu", "--out", str(out), "--steps",
                     "3", "--warmup", "1", "--numerics-steps", "2", "--peak-size", "128",
                     "--batch-size", "16"])
    text = text.getvalue()
    assert code == 0, text
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["rung"] for r in records) == sorted(SHORT_CPU_LADDER)
    lines = text.rstrip().splitlines()
    last = lines[-1]
    assert last.startswith("conclusion: ") and FULL in last, last
    rates = {r["rung"]: r["figures"]["samples_per_s"]["median"] for r in records}
    best = max((r for r in rates if r != "plain"), key=rates.get)
    ratio = f"{rates[best] / rates['plain']:.2f}x plain"
    assert best in last and ratio in last, (last, rates)
    assert re.search(r"(inside|outside) the noise", last), last
    # the title's count of windows is the one measured
    counts = sorted({r["figures"]["samples_per_s"]["n"] for r in records})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    assert f"median of {n} windows x 3 steps" in text
    # the peak's first-principles paragraph is said once
    assert text.count("first principles") == 1, text
