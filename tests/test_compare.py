"""``kasoku compare``: the CPU side end to end in CI size (real worker processes through
bench's sweep), the time-to-accuracy form on a slice of real MNIST (synthetic without it), and
the reading, table, notes, chart and side-by-side log on constructed results (the GPU side
cannot run here)."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from kasoku.cli import main
from kasoku.commands.bench import compare as cmp
from kasoku.commands.bench.compare_report import (
    notes,
    plot_compare,
    print_compare,
    side_by_side,
    table_rows,
    totals_line,
)
from kasoku.workloads import create_workload, list_workloads

PNG = b"\x89PNG\r\n\x1a\n"
FAST = ["--steps", "2", "--windows", "2", "--warmup", "1", "--numerics-steps", "3",
        "--threads", "1", "--peak-size", "128"]


@pytest.mark.slow
def test_compare_mnist_mlp_on_the_cpu(tmp_path, capsys):
    """`kasoku compare mnist-mlp --devices cpu` in CI size: each rung a worker process, the
    best one picked, one kasoku.compare/1 line, the table, the chart."""
    out = tmp_path / "cmp"
    code = main(["compare", "mnist-mlp", "--devices", "cpu", "--cpu-config", "+fused",
                 "--batch-size", "16", "--out", str(out), *FAST])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    (line,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert line["schema"] == "kasoku.compare/1" and line["form"] == "throughput"
    assert line["workload"] == "mnist-mlp" and line["unit"] == "samples"
    assert line["epoch_samples"] == 60_000
    assert line["cuda"] is None and line["speedup"] is None and line["peak_ratio"] is None
    cpu = line["cpu"]
    bench = [json.loads(x) for x in
             (out / "bench-mnist-mlp-cpu" / "results.jsonl").read_text().splitlines()]
    assert {r["rung"] for r in bench} == {"plain", "+fused"}
    fastest = max((r for r in bench if r["numerics"]["status"] == "ok"),
                  key=lambda r: r["figures"]["samples_per_s"]["median"])
    assert cpu["rung"] == fastest["rung"] and cpu["batch_size"] == 16
    assert cpu["samples_per_s"] == fastest["figures"]["samples_per_s"]["median"]
    assert cpu["sweep_id"] == fastest["sweep_id"] and cpu["numerics"] == "ok"
    assert cpu["compute_dtype"] == "fp32" and cpu["peak_flops_per_s"] > 0
    assert cpu["mfu"] == fastest["figures"]["mfu"]
    assert cpu["epoch_s"] == pytest.approx(60_000 / cpu["samples_per_s"])
    assert cpu["window"]["steps"] == 2 and cpu["window"]["windows"] == 2
    assert cpu["epoch_extrapolated_from_steps"] == 4 and not cpu["window"]["shortened"]
    assert "theoretical_peak_flops_per_s" in cpu
    text = printed.out
    assert "# [1/1] mnist-mlp on cpu: 2 rungs (plain, +fused) at batch 16" in text
    assert text.count("only the CPU was measured") == 1
    table = text[text.index("kasoku compare:"):]
    assert "CPU best rung" in table and "1 GPU" not in table.splitlines()[1]
    assert "epoch times are extrapolated" in table and "mnist-mlp cpu 2 x 2" in table
    assert "2 GPUs: not measured here" in table
    assert (out / "compare.png").read_bytes()[:8] == PNG


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_saying_what_to_do(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["compare", "mnist-mlp", "--devices", "cpu,cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("kasoku: error: --devices cpu,cuda: ")
    assert "no CUDA device" in err and "--devices cpu" in err
    assert not out.exists()


@pytest.mark.parametrize("value, says", [("auto", "name the devices"),
                                         ("cpu,cpu", "each kind of device once"),
                                         ("tpu", "auto, cpu, cuda or cuda:N")])
def test_bad_devices_are_refused_where_parsed(value, says, capsys):
    assert main(["compare", "mnist-mlp", "--devices", value]) == 2
    assert says in capsys.readouterr().err


def test_epochs_takes_one_workload(capsys):
    assert main(["compare", "mnist-mlp,sine-lstm", "--devices", "cpu", "--epochs", "1"]) == 2
    assert "give one workload" in capsys.readouterr().err


def _side(rate, peak, mfu, dtype="bf16", rung="r", **extra):
    return {"rung": rung, "batch_size": 32, "samples_per_s": rate, "peak_flops_per_s": peak,
            "mfu": mfu, "compute_dtype": dtype, "bench_out": "b", "epoch_s": 1000 / rate,
            "window": {"steps": 20, "windows": 3, "shortened": False}, **extra}


@pytest.mark.parametrize("cpu, gpu, says", [
    # The ResNet-50 figures measured on a 16-core Xeon and an H200.
    (_side(56, 4.58e12, 0.30), _side(7861, 788e12, 0.24),
     "the GPU is 140x faster here; its peak is 172x the CPU's: the CPU path uses a larger "
     "share of its peak (30% of its bf16 peak against 24% of its bf16 peak)"),
    (_side(100, 1e12, 0.10), _side(5000, 10e12, 0.50),
     "the GPU is 50x faster here; its peak is 10x the CPU's: the GPU uses a larger share of "
     "its peak"),
    (_side(100, 1e12, 0.40), _side(1000, 10e12, 0.42),
     "the GPU is 10x faster here; its peak is 10x the CPU's: both use about the same share"),
    (_side(1000, 1e12, 0.40), _side(500, 100e12, 0.002),
     "the CPU is 2.0x faster here; the GPU's peak is 100x the CPU's: the CPU path uses a "
     "larger share"),
    # MFU withheld on one side: the shares' ratio is the speed-up over the peak ratio.
    (_side(100, 1e12, None), _side(3000, 10e12, 0.5),
     "the GPU is 30x faster here; its peak is 10x the CPU's: the GPU uses a larger share of "
     "its peak"),
    (_side(100, None, None), _side(3000, 10e12, 0.5),
     "the GPU is 30x faster here; no measured peak to compare the shares"),
])
def test_reading(cpu, gpu, says):
    line = cmp.summarize("w", "images", 1000, cpu, gpu)
    assert line["reading"].startswith(says), line["reading"]
    assert line["speedup"] == pytest.approx(gpu["samples_per_s"] / cpu["samples_per_s"])


def test_a_reading_from_unstable_or_overlapping_rates_says_so():
    cpu, gpu = _side(100, 1e12, 0.40), _side(1000, 10e12, 0.42)
    shaky = {**cpu, "unstable": True, "rate_range": {"min": 60.0, "max": 180.0}}
    steady = {**gpu, "rate_range": {"min": 990.0, "max": 1010.0}}
    line = cmp.summarize("w", "images", 1000, shaky, steady)
    assert line["reading"].startswith(
        "the GPU is 10x faster here (unstable: the CPU's windows ranged 60-180; the ratios "
        "are approximate: measure again on a quiet machine); its peak is 10x the CPU's")
    near = cmp.summarize("w", "images", 1000, {**cpu, "rate_range": {"min": 80.0, "max": 120.0}},
                         {**_side(110, 10e12, 0.04), "rate_range": {"min": 105, "max": 115}})
    assert near["reading"] == ("the two devices' rates are within the noise of each other "
                               "(CPU 80-120, GPU 105-115 images/s over their windows): no "
                               "faster device here")
    alone = cmp.summarize("w", "images", 1000, shaky, None)["reading"]
    assert alone.startswith("only the CPU was measured: r at 100 images/s (unstable: the "
                            "CPU's windows ranged 60-180; the figures are approximate")
    # a line saved before the ranges were kept reads as before
    assert cmp.summarize("w", "images", 1000, cpu, gpu)["reading"].startswith("the GPU is 10x")


def test_reading_with_one_side_or_none_passed():
    only = cmp.summarize("w", "samples", None, _side(4000, 1e11, 0.6, "fp32", "+fused"), None)
    assert only["reading"] == ("only the CPU was measured: +fused at 4,000 samples/s, 60% of "
                               "its fp32 peak; add --devices cpu,cuda on a machine with a GPU "
                               "for the comparison")
    failed = cmp.summarize("w", "samples", None, _side(4000, 1e11, 0.6),
                           {"rung": None, "samples_per_s": None, "bench_out": "OUT/b"})
    assert failed["reading"].startswith("no GPU rung finished with its numerics check passed "
                                        "(see OUT/b)")
    assert failed["speedup"] is None


def _record(rung, rate, numerics="ok", status="ok"):
    return {"rung": rung, "batch_size": 8, "status": status, "numerics": {"status": numerics},
            "figures": {"samples_per_s": {"median": rate}} if rate else {}}


def test_best_run_is_the_fastest_whose_numerics_passed():
    best, how = cmp.best_run([_record("plain", 10), _record("+bf16", 30, "FAIL"),
                              _record("+fused", 20), _record("x", None, status="oom")])
    assert best["rung"] == "+fused" and "numerics check passed" in how
    best, how = cmp.best_run([_record("plain", 10, "n/a"), _record("+fused", 20, "n/a")])
    assert best["rung"] == "+fused" and "not checked" in how
    assert cmp.best_run([_record("+bf16", 30, "FAIL")])[0] is None


def test_window_is_shortened_for_long_steps_only():
    mlp = cmp.plan_window(1e9, "cpu", 3)  # ~10 ms at the assumed rate: bench's window
    assert (mlp.steps, mlp.warmup, mlp.shortened) == (30, 3, False)
    resnet = cmp.plan_window(4e11, "cpu", 3)  # ~4 s a step: 30 s of timed steps -> 2 each
    assert (resnet.steps, resnet.warmup, resnet.shortened) == (2, 1, True)
    assert resnet.to_dict()["timed_steps"] == 6
    huge = cmp.plan_window(1e14, "cpu", 3)
    assert huge.steps == 1 and huge.estimated_step_s == pytest.approx(1000)
    given = cmp.plan_window(1e14, "cpu", 3, steps=5, warmup=0)
    assert (given.steps, given.warmup, given.shortened) == (5, 0, False)


def test_table_notes_and_chart_of_several_workloads(tmp_path, capsys):
    gpu2 = {"samples_per_s": 4000.0, "rung": "+cuda-graph", "global_batch_size": 64,
            "source": "SCALE"}
    cpu = _side(100, 1e12, 0.4, "fp32", "+fused", theoretical_peak_flops_per_s=2e12)
    slow = _side(5, 1e12, 0.3, "bf16", "+channels_last")
    slow["window"] = {"steps": 1, "windows": 3, "shortened": True, "estimated_step_s": 3.9,
                      "assumed_flops_per_s": 1e11}
    lines = [cmp.summarize("mlp", "samples", 60_000, cpu, _side(5000, 100e12, 0.1), gpu2),
             cmp.summarize("resnet", "images", 1_281_167, slow, _side(700, 100e12, 0.2))]
    headers, rows = table_rows(lines)
    assert headers[-4:] == ["2 GPUs rate", "2 GPUs epoch", "GPU/CPU", "peak ratio"]
    assert rows[0][:5] == ["mlp", "+fused (bs 32)", "100", "40% fp32", "10 s"]
    assert rows[1][4] == "3.3 min*" and rows[1][-2:] == ["140x", "100x"]
    assert rows[0][9:11] == ["4,000", "15 s"] and rows[1][9:11] == ["-", "-"]
    text = "\n".join(notes(lines))
    assert "resnet cpu 3 x 1 (shortened*: an estimated 3.9 s per step" in text
    assert "mlp CPU fp32 1 TFLOP/s measured, 2 first-principles (the measured is 50% of it)" \
        in text
    assert "2 GPUs: mlp +cuda-graph, global batch 64, from SCALE" in text
    print_compare(lines)
    assert "resnet: the GPU is 140x faster here" in capsys.readouterr().out
    assert plot_compare(lines, tmp_path / "c.png").read_bytes()[:8] == PNG


def test_two_gpu_rates_come_from_scale_results(tmp_path):
    rows = [{"schema": "kasoku.scale/1", "workload": "w", "world_size": n, "device_type": d,
             "samples_per_s": 100.0 * n, "rung": "r", "global_batch_size": 64 * n}
            for n, d in ((1, "cuda"), (2, "cuda"), (2, "cpu"))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rates = cmp.two_gpu_rates(tmp_path)
    assert rates == {"w": {"samples_per_s": 200.0, "rung": "r", "global_batch_size": 128,
                           "source": str(tmp_path)}}


def test_first_principles_cpu_peak_is_the_bench_records():
    # The probe's estimate is of the cores it ran on (--threads): the compare line takes it
    # from the record rather than working out one of its own for the whole CPU.
    window = cmp.Window(30, 3, 3, None, 1e9, False)
    best = _record("+fused", 20)
    best["figures"].update(compute_dtype="fp32", peak_flops_per_s=1e11,
                           peak={"flops_per_s": 1e11, "theory": {"flops_per_s": 2e11}})
    side = cmp.side_figures(best, "fastest", window, "OUT", "cpu", 40)
    assert side["theoretical_peak_flops_per_s"] == 2e11
    del best["figures"]["peak"]["theory"]  # no estimate for this CPU or dtype
    assert cmp.side_figures(best, "fastest", window, "OUT", "cpu", 40)[
        "theoretical_peak_flops_per_s"] is None
    assert "theoretical_peak_flops_per_s" not in cmp.side_figures(best, "fastest", window,
                                                                  "OUT", "cuda", 40)


def test_side_by_side_log_of_two_devices():
    cpu = [{"epoch": 1, "main/loss": 0.2, "validation/main/loss": 0.11, "main/accuracy": 0.94,
            "validation/main/accuracy": 0.966, "elapsed_time": 7.47},
           {"epoch": 2, "main/loss": 0.07, "validation/main/loss": 0.08,
            "main/accuracy": 0.977, "validation/main/accuracy": 0.973, "elapsed_time": 14.8}]
    gpu = [{"epoch": 1, "main/loss": 0.21, "validation/main/loss": 0.1, "main/accuracy": 0.93,
            "validation/main/accuracy": 0.967, "elapsed_time": 0.1}]
    rows = side_by_side({"cpu": cpu, "cuda": gpu})
    assert rows[0].split() == ["|", "cpu", "|", "cuda"]
    assert rows[1].split("|")[1].split() == rows[1].split("|")[2].split() == \
        ["main/loss", "validation/main/loss", "main/accuracy", "validation/main/accuracy",
         "elapsed_time"]
    one = rows[2].split("|")
    assert one[0].strip() == "1" and one[1].split() == ["0.2", "0.11", "0.94", "0.966", "7.47"]
    assert one[2].split() == ["0.21", "0.1", "0.93", "0.967", "0.1"]
    two = rows[3].split("|")
    assert two[2].strip() == ""  # no second epoch on the GPU: blanks
    assert len({len(r.split("|")[0]) for r in rows}) == 1  # the columns line up
    assert totals_line({"cpu": 131.866, "cuda": 34.7934}) == \
        "total: cpu 131.9 s, cuda 34.8 s; cuda is 3.79x as fast as cpu"


def _mnist_slice(src, dst, n_train=1000, n_val=500):
    """The first samples of real MNIST's four files: the same format, smaller."""
    dst.mkdir()
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        for kind, header, size in (("images-idx3", 16, 784), ("labels-idx1", 8, 1)):
            name = f"{prefix}-{kind}-ubyte.gz"
            raw = gzip.decompress((src / name).read_bytes())
            head = bytearray(raw[:header])
            head[4:8] = n.to_bytes(4, "big")
            (dst / name).write_bytes(gzip.compress(bytes(head) + raw[header:header + n * size]))
    return dst


@pytest.mark.slow
def test_time_to_accuracy_on_one_device(tmp_path, capsys):
    from conftest import SHARED_DATA
    real = SHARED_DATA / "mnist"
    data = ["--data", str(_mnist_slice(real, tmp_path / "mnist"))] \
        if (real / "train-images-idx3-ubyte.gz").exists() else \
        ["--synthetic", "--synthetic-size", "1000"]
    out = tmp_path / "tta"
    code = main(["compare", "mnist-mlp", "--devices", "cpu", "--epochs", "1", "--threads", "1",
                 "--out", str(out), *data])
    text = capsys.readouterr().out
    assert code == 0
    assert "loader, 1 epoch\n" in text  # not "1 epochs"
    (line,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert line["schema"] == "kasoku.compare/1" and line["form"] == "time-to-accuracy"
    run = line["devices"]["cpu"]
    assert run["label"] == "+fused" and run["config"]["optimizer_impl"] == "fused"
    assert run["loader"] == "serial" and len(run["log"]) == 1
    final = run["final"]
    assert final["epoch"] == 1 and 0 <= final["validation/main/accuracy"] <= 1
    assert run["elapsed_s"] == final["elapsed_time"] > 0
    assert (tmp_path / "tta" / run["out"].split("/")[-1] / "log.jsonl").exists()
    side = text[text.index("the logs side by side"):]
    assert "validation/main/accuracy" in side and f"total: cpu {run['elapsed_s']:.1f} s" in side


def test_report_redraws_the_latest_line_of_each_workload(tmp_path, capsys):
    assert main(["compare", "mnist-mlp", "--report", "--out", str(tmp_path)]) == 2
    assert "give their --out folder" in capsys.readouterr().err
    old = cmp.summarize("mnist-mlp", "samples", 60_000, _side(50, 1e12, 0.2), None)
    new = cmp.summarize("mnist-mlp", "samples", 60_000, _side(100, 1e12, 0.4, "fp32"), None)
    lstm = cmp.summarize("sine-lstm", "samples", 10_000, _side(900, 1e12, None, "fp32"), None)
    with open(tmp_path / "results.jsonl", "w") as f:
        for line in (old, lstm, new, {"schema": "kasoku.bench/1", "workload": "mnist-mlp"}):
            f.write(json.dumps({"schema": cmp.SCHEMA, "form": "throughput", **line}) + "\n")
    assert main(["compare", "sine-lstm,mnist-mlp", "--report", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    rows = [ln.split("  ") for ln in text.splitlines() if ln.startswith(("sine-lstm  ",
                                                                        "mnist-mlp  "))]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    assert [c[0] for c in cells] == ["sine-lstm", "mnist-mlp"]  # in the order asked for
    assert cells[1][2] == "100"  # the latest mnist-mlp line, not the earlier one's 50
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG
    assert main(["compare", "cifar10-lenet5", "--report", "--out", str(tmp_path)]) == 2
    assert "no comparison of cifar10-lenet5" in capsys.readouterr().err


@pytest.mark.parametrize("name", list_workloads())
def test_every_workload_knows_its_real_epoch(name):
    """What compare extrapolates an epoch to: a new workload says it too."""
    samples = create_workload(name).epoch_samples
    assert isinstance(samples, int) and samples > 0


def test_the_reading_is_said_once(tmp_path, monkeypatch, capsys):
    side = _side(4000, 1e11, 0.6, "fp32", "+fused")
    monkeypatch.setattr(cmp, "_measure_side", lambda *a: (side, 0))
    lines, code = cmp.run_compare(cmp.CompareConfig(("mnist-mlp",), ("cpu",), tmp_path))
    print_compare(lines)
    assert code == 0 and capsys.readouterr().out.count("only the CPU was measured") == 1
