"""``kasoku scale`` on the CPU: real worker processes started by PyTorch's elastic launcher,
training the MNIST MLP with DDP over gloo; the figures each record must hold together, the
explanation's rules on records made to show each cause, and the failure path."""
from __future__ import annotations

import json
import statistics

import pytest

from kasoku.cli import main
from kasoku.commands import scale
from kasoku.commands.scale_worker import FAIL_ENV, SCHEMA
from kasoku.distributed.plan import cpu_cores

PNG = b"\x89PNG\r\n\x1a\n"


def test_mnist_mlp_on_1_and_2_processes(tmp_path, capsys):
    """The acceptance run: `kasoku scale mnist-mlp --procs 1,2` measures, tabulates, explains
    and draws."""
    out = tmp_path / "scale"
    code = main(["scale", "mnist-mlp", "--procs", "1,2", "--steps", "4", "--windows", "3",
                 "--warmup", "2", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records] == [1, 2]
    for r in records:
        n = r["world_size"]
        assert r["schema"] == SCHEMA and r["backend"] == "gloo" and r["rung"] == "+fused"
        assert r["global_batch_size"] == 100 * n
        assert r["threads_per_worker"] == max(1, cpu_cores() // n)
        # 3 windows, and more where they disagreed (the noise rule)
        assert len(r["step_ms_windows"]) == 3 + r["stability"]["extra_windows"]
        assert len(r["alone_step_ms_windows"]) == 3 + r["alone_stability"]["extra_windows"]
        assert r["step_ms"] == statistics.median(r["step_ms_windows"])  # the median window
        assert r["samples_per_s"] == pytest.approx(100 * n / (r["step_ms"] / 1e3))
        assert r["exposed_allreduce_ms"] == pytest.approx(max(0.0, r["step_ms"]
                                                              - r["alone_step_ms"]))
        assert r["allreduce_alone_ms"] > 0
        # The MLP's weights (784*1000 + 1000*1000 + 1000*10 and biases) in fp32 buckets of 25 MB.
        assert r["grad_mb"] == pytest.approx(4 * 1_796_010 / 1e6)
        assert r["allreduce_buckets"] == 1
    table = printed.out
    assert "speed-up over 1 worker alone (no DDP)" in table
    assert "mnist-mlp, 1 worker through DDP:" in table
    two = next(line for line in table.splitlines() if line.startswith("mnist-mlp, 2 workers"))
    rows = scale.summarize(records)
    assert f"{rows[1]['speedup']:.2f}x the throughput of 1 worker alone" in two
    assert f"({rows[1]['efficiency']:.0%} scaling efficiency)" in two
    assert (out / "scale.png").read_bytes()[:8] == PNG


def test_a_sharded_gpt_on_2_processes(tmp_path, capsys):
    """`kasoku scale gpt --shard`: FSDP2 is the data-parallel step, its communication alone
    all-gathers and reduce-scatters each unit (2 blocks and the root: 7 exchanges), and the
    workload's settings reach the workers."""
    out = tmp_path / "scale"
    code = main(["scale", "gpt", "--model-size", "tiny", "--procs", "2", "--shard",
                 "--steps", "3", "--windows", "3", "--warmup", "1", "--batch-size", "8",
                 "--out", str(out), "--no-chart"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    (r,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert r["workload"] == "gpt:model_size=tiny" and r["unit"] == "tokens"
    assert (r["strategy"], r["comm"]) == ("fsdp2", "all-gather + reduce-scatter")
    assert r["allreduce_buckets"] == 7 and r["allreduce_alone_ms"] > 0
    from kasoku.workloads import create_workload
    params = sum(p.numel() for p in create_workload("gpt").build_model().parameters())
    assert r["grad_mb"] == pytest.approx(4 * params / 1e6)  # whole units, not one shard
    assert r["samples_per_s"] == pytest.approx(2 * 8 * 64 / (r["step_ms"] / 1e3))
    assert "FSDP2 over gloo" in printed.out and "exposed gather/scatter (ms)" in printed.out


def test_shard_refuses_a_step_fsdp2_cannot_take(tmp_path, capsys):
    code = main(["scale", "gpt", "--procs", "2", "--shard", "--config",
                 "compile=reduce-overhead", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--shard with compile mode" in err and "Traceback" not in err


def _record(n, step_ms, alone_ms, comm_ms, device="cpu", threads=1, **extra):
    return {"workload": "w", "unit": "samples", "world_size": n, "device_type": device,
            "backend": "gloo" if device == "cpu" else "nccl", "rung": "r",
            "config": {"cuda_graph": False}, "batch_size_per_worker": 100,
            "global_batch_size": 100 * n, "threads_per_worker": threads,
            "allreduce_dtype": "fp32", "step_ms": step_ms, "alone_step_ms": alone_ms,
            "exposed_allreduce_ms": max(0.0, step_ms - alone_ms),
            "exposed_allreduce_pct": 100 * max(0.0, step_ms - alone_ms) / step_ms,
            "allreduce_alone_ms": comm_ms, "samples_per_s": 100 * n / (step_ms / 1e3),
            "alone_samples_per_s_per_worker": 100 / (alone_ms / 1e3), **extra}


def test_an_exposed_all_reduce_is_named_with_what_would_help():
    rows = scale.summarize([_record(1, 10.0, 10.0, 0.1, device="cuda"),
                            _record(4, 16.0, 10.0, 8.0, device="cuda")])
    assert rows[1]["speedup"] == pytest.approx(4 * 10 / 16)
    assert rows[1]["efficiency"] == pytest.approx(10 / 16)
    line = rows[1]["explanation"]
    assert "4 workers: 2.50x the throughput of 1 worker alone (62% scaling efficiency)" in line
    assert "38% of each step (6.00 ms of 16.00) is all-reduce not hidden" in line
    assert "2.00 ms of it is hidden" in line
    assert "bigger per-worker batch" in line and "--allreduce-dtype bf16" in line
    assert "CUDA-graph step" in line
    assert "share" not in line  # the workers alone run as fast as one


def test_bf16_on_the_wire_is_offered_only_where_the_bytes_set_the_all_reduces_time():
    # the MNIST MLP on 2 H200s: 7.2 MB in one bucket, 0.13 ms in fp32 and in bf16
    small = _record(2, 0.23, 0.15, 0.13, device="cuda", grad_mb=7.2, allreduce_buckets=1)
    line = scale.summarize([_record(1, 0.15, 0.15, 0.05, device="cuda"), small])[1][
        "explanation"]
    assert "(the all-reduce alone takes 0.13 ms; 1 bucket of 7.2 MB: its time is the calls' " \
           "latency, not the bytes; 0.05 ms of it is hidden)" in line
    assert "bigger per-worker batch" in line and "--allreduce-dtype" not in line
    # ResNet-50's 102 MB in four buckets of DDP's 25 MB: the bytes set it
    large = _record(2, 16.0, 10.0, 8.0, device="cuda", grad_mb=102.0, allreduce_buckets=4)
    line = scale.summarize([_record(1, 10.0, 10.0, 0.1, device="cuda"), large])[1][
        "explanation"]
    assert "--allreduce-dtype bf16 (half the bytes)" in line and "latency" not in line
    # gloo between CPU processes: not judged by NCCL's measure
    cpu = _record(2, 0.23, 0.15, 0.13, grad_mb=7.2, allreduce_buckets=1)
    line = scale.summarize([_record(1, 0.15, 0.15, 0.05), cpu])[1]["explanation"]
    assert "--allreduce-dtype bf16" in line and "latency" not in line


def test_workers_sharing_cores_are_named_first_when_they_cost_most():
    rows = scale.summarize([_record(1, 10.0, 10.0, 0.1, threads=2),
                            _record(2, 22.0, 19.0, 2.0, threads=1)])
    line = rows[1]["explanation"]
    cores = line.index("share this CPU's cores (1 thread each)")
    assert "1.90x one worker's" in line
    assert cores < line.index("all-reduce not hidden") if "all-reduce not hidden" in line \
        else True
    assert "one process with all the cores" in line


def test_an_exposed_time_beyond_the_all_reduce_alone_says_they_contend():
    line = scale.summarize([_record(1, 10.0, 10.0, 0.1),
                            _record(2, 20.0, 10.0, 4.0)])[1]["explanation"]
    assert "more than the all-reduce alone takes (4.00 ms)" in line


def test_good_scaling_says_the_all_reduce_is_hidden():
    rows = scale.summarize([_record(1, 100.0, 100.0, 0.1, device="cuda"),
                            _record(2, 101.0, 100.0, 20.0, device="cuda")])
    assert rows[1]["efficiency"] == pytest.approx(100 / 101)
    assert rows[1]["explanation"].endswith(
        "; the all-reduce (20.00 ms alone) is hidden behind the backward pass but for 1.00 ms")


def test_without_a_1_worker_run_the_baseline_says_so():
    rows = scale.summarize([_record(2, 20.0, 10.0, 4.0), _record(4, 30.0, 10.0, 8.0)])
    assert rows[0]["baseline"] == "one of 2 workers alone (no 1-worker run)"
    assert rows[0]["efficiency"] == pytest.approx(0.5)  # 200 per 20 ms over 2 x 100 per 10 ms


def test_a_failed_worker_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "1")
    out = tmp_path / "scale"
    code = main(["scale", "mnist-mlp", "--procs", "2", "--steps", "2", "--windows", "1",
                 "--warmup", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    line = next(x for x in err.splitlines() if x.startswith("kasoku: error:"))
    assert "mnist-mlp with 2 workers: rank 1 failed" in line
    assert f"simulated failure of rank 1 ({FAIL_ENV})" in line
    kept = out / "stderr-2workers-rank1.log"
    assert kept.is_file() and str(kept) in line
    assert "Traceback" not in err.replace(kept.read_text(), "")


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "2"], "--gpus needs CUDA"),
    (["--procs", "1", "--gpus", "1"], "not allowed with argument"),
    (["--procs", "2", "--bucket-mb", "0"], "argument --bucket-mb: must be a positive"),
    (["--procs", "2", "--config", "precision=nope"], "precision"),
    (["--device", "cuda"], "--device cuda: torch sees no GPU here; give --device cpu"),
    (["--device", "cpu", "--gpus", "1"], "with --device cpu give the CPU processes' counts"),
    (["--device", "cuda:1"], "give --device cuda, and --gpus N[,N...] for the counts"),
    (["--device", "tpu"], "must be auto, cpu, cuda or cuda:N"),
])
def test_requests_this_machine_cannot_run(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code = main(["scale", "mnist-mlp", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--gpus", "--procs"])
def test_bench_points_to_scale_for_several_workers(capsys, flag):
    assert main(["bench", "mnist-mlp", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert "kasoku scale WORKLOAD --gpus" in err and "Traceback" not in err


def test_device_chooses_the_kind_of_worker_as_every_command_does():
    from kasoku.cli.scale import counts_on
    assert counts_on("auto", None, [2]) == (None, [2])
    assert counts_on("cpu", None, None) == (None, [1, 2])
    assert counts_on("cpu", None, [4]) == (None, [4])


def _stability(median, low, high, stable):
    return {"stable": stable, "median": median, "min": low, "max": high,
            "reasons": [] if stable else ["its 9 windows range over 100% of their median"]}


def test_a_speed_up_from_unstable_windows_is_said_so_with_no_cause_drawn(tmp_path, capsys):
    # The case of the report: one worker alone ranged widely, so 2 workers looked superlinear.
    one = _record(1, 20.0, 20.0, 0.1, stability=_stability(20.0, 19.0, 21.0, True),
                  alone_stability=_stability(20.0, 10.0, 30.0, False))
    two = _record(2, 11.2, 9.0, 4.0, stability=_stability(11.2, 11.0, 11.5, True),
                  alone_stability=_stability(9.0, 8.8, 9.2, True))
    rows = scale.summarize([one, two])
    assert rows[1]["efficiency"] == pytest.approx(20 / 11.2)
    assert rows[1]["unstable"] == ["1 worker's step alone (the baseline)"]
    low, high = rows[1]["efficiency_range"]
    assert low == pytest.approx(10 / 11.5) and high == pytest.approx(30 / 11.0)
    line = rows[1]["explanation"]
    assert line.startswith("w, 2 workers: 3.57x the throughput of 1 worker alone (179% scaling "
                           "efficiency), but the figures it rests on are unstable (1 worker's "
                           "step alone (the baseline): the ! lines below say why); from their "
                           "windows the efficiency lies anywhere from 87% to 273%, so no cause "
                           "is drawn from it")
    assert line.endswith("with more --windows")
    assert "slow each other" not in line and "Would help" not in line
    # the table marks the speed-up and the efficiency; the chart hatches the bars
    scale.print_results([one, two])
    table = capsys.readouterr().out
    assert "3.57x!" in table and "179%!" in table
    stable = scale.summarize([dict(one, alone_stability=_stability(20.0, 19.5, 20.5, True)),
                              two])
    assert not stable[1]["unstable"] and "but the figures" not in stable[1]["explanation"]
    one["env"] = {}
    path = scale.plot_scale([one, two], tmp_path / "scale.png")
    assert path.read_bytes()[:8] == PNG
