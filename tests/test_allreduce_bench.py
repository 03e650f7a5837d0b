"""``kasoku allreduce-bench`` on the CPU: real worker processes started by PyTorch's elastic
launcher, all-reducing over gloo; the sizes, the bandwidth arithmetic, the table, and the
requests this machine cannot run refused in one line."""
from __future__ import annotations

import json
import signal
import statistics

import pytest
import torch

from kasoku.cli import main
from kasoku.commands import allreduce_bench as arb
from kasoku.commands.allreduce_worker import FAIL_ENV
from kasoku.core.errors import ConfigError
from kasoku.distributed.plan import plan_worlds


@pytest.mark.parametrize("text, size", [("4096", 4096), ("4K", 4096), ("1M", 2 ** 20),
                                        ("64m", 64 * 2 ** 20), ("2G", 2 ** 31),
                                        ("16KiB", 16384), ("8KB", 8192)])
def test_sizes_are_powers_of_1024(text, size):
    assert arb.parse_size(text) == size
    assert arb.parse_size(arb.format_size(size)) == size


@pytest.mark.parametrize("text", ["", "K", "0", "0K", "1.5M", "4Q", "-4K", "4 M"])
def test_bad_sizes_say_what_to_give(text):
    with pytest.raises(ConfigError, match="N, NK, NM or NG"):
        arb.parse_size(text)


def test_the_default_ladder_goes_by_4_up_to_the_max():
    assert arb.default_sizes(256 * 2 ** 20) == [4 * 4 ** k * 2 ** 10 for k in range(9)]
    assert arb.default_sizes(2 ** 20)[-2:] == [256 * 2 ** 10, 2 ** 20]
    assert arb.default_sizes(2 ** 21)[-2:] == [2 ** 20, 2 ** 21]  # the max ends it
    assert arb.default_sizes(1024) == [1024]


@pytest.mark.parametrize("n, factor", [(1, 1.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_is_nccl_tests_busbw(n, factor):
    algbw, busbw = arb.bandwidths(2 ** 20, 1000.0, n)
    assert algbw == 2 ** 20 / 1e6  # bytes per microsecond / 1e3 = GB/s
    assert busbw == pytest.approx(algbw * factor, rel=1e-15)


def test_sizes_must_be_whole_elements():
    assert arb.check_sizes([2 ** 20, 4096, 4096], "fp32") == (4096, 2 ** 20)
    assert arb.check_sizes([6], "bf16") == (6,)
    with pytest.raises(ConfigError, match="multiple of 4"):
        arb.check_sizes([6], "fp32")


def test_procs_1_and_2_over_gloo(tmp_path, capsys):
    """The acceptance run: two launches (1 and 2 processes), three sizes each."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "arb"
    code = main(["allreduce-bench", "--procs", "1,2", "--sizes", "4K,64K,1M", "--warmup", "2",
                 "--iters", "5", "--reps", "3", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    # The launcher's signal handlers are not left behind in the calling process.
    assert {s: signal.getsignal(s) for s in handlers} == handlers

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["world_size"], r["size_bytes"]) for r in records] == \
        [(n, s) for n in (1, 2) for s in (4096, 65536, 2 ** 20)]
    for r in records:
        n = r["world_size"]
        assert r["schema"] == "kasoku.allreduce_bench/1"
        assert (r["backend"], r["device_type"], r["dtype"]) == ("gloo", "cpu", "fp32")
        assert r["count"] == r["size_bytes"] // 4 and r["wrong"] == 0
        # 3 timed batches, up to 9 where they disagree (the noise rule)
        assert 3 <= len(r["times_us"]) <= 9 and all(t > 0 for t in r["times_us"])
        assert len(r["times_us"]) == 9 or r["stability"]["stable"]  # stopped when they agree
        assert r["time_us"] == statistics.median(r["times_us"])
        assert r["algbw_gbps"] == r["size_bytes"] / (r["time_us"] * 1e3)
        assert r["busbw_gbps"] == (r["algbw_gbps"] * 2 * (n - 1) / n if n > 1
                                   else r["algbw_gbps"])
        assert r["algorithm"] == "backend's choice" and r["nccl_version"] is None
        assert (r["warmup"], r["iters"], r["reps"]) == (2, 5, 3)
        assert r["env"]["torch"] == torch.__version__
    assert len({r["run_id"] for r in records}) == 2  # one launch per world size

    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("procs"))
    assert lines[header].split()[:4] == ["procs", "backend", "dtype", "size"]
    rows = [line.split() for line in lines[header + 1:header + 7]]
    assert [(row[0], row[3]) for row in rows] == \
        [(n, s) for n in ("1", "2") for s in ("4K", "64K", "1M")]
    for row, r in zip(rows, records):
        # the median time, marked ! where its batches disagree by more than 10%
        assert row[5] == f"{r['time_us']:.1f}" + ("" if r["stability"]["stable"] else "!")
        assert row[8] == f"{r['busbw_gbps']:.3f}"
    assert "algorithm: backend's choice" in printed.out
    assert (out / "busbw.png").stat().st_size > 0


def test_a_failed_worker_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "1")
    out = tmp_path / "arb"
    assert main(["allreduce-bench", "--procs", "2", "--sizes", "4K", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("kasoku: error: all-reduce with 2 processes: rank 1 failed")
    assert "simulated failure of rank 1" in err[0]  # the cause, not the peer's lost connection
    kept = out / "stderr-2procs-rank1.log"
    assert str(kept) in err[0] and "Traceback" in kept.read_text()


def no_cuda(monkeypatch, count=0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("argv, gpus, message", [
    (["--gpus", "2"], 0, "--gpus needs CUDA and torch sees no GPU here; use --procs N for "
     "gloo on the CPU"),
    (["--gpus", "1,4"], 2, "--gpus 4: only 2 GPUs visible (torch.cuda.device_count()); give "
     "at most 2"),
    (["--procs", "2", "--sizes", "4K,6"], 0, "size 6 is not a whole number of fp32 elements"),
    (["--procs", "2", "--dtype", "bf16", "--sizes", "3"], 0, "give a multiple of 2"),
])
def test_requests_this_machine_cannot_run(tmp_path, capsys, monkeypatch, argv, gpus, message):
    no_cuda(monkeypatch, gpus)
    monkeypatch.chdir(tmp_path)  # the default folder would be made under ./runs
    assert main(["allreduce-bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kasoku: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before any folder is made


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "1", "--procs", "2"], "not allowed with argument"),
    (["--sizes", "4K", "--max-size", "1M"], "not allowed with argument"),
    (["--sizes", "4Q"], "give bytes as N, NK, NM or NG"),
    (["--dtype", "fp64"], "must be one of fp32, bf16, fp16"),
    (["--iters", "0"], "must be a whole number >= 1"),
])
def test_bad_values_are_one_line(capsys, argv, message):
    assert main(["allreduce-bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_default_without_cuda_is_2_processes(monkeypatch):
    no_cuda(monkeypatch)
    plan = plan_worlds()
    assert (plan.backend, plan.world_sizes, plan.device_type) == ("gloo", (2,), "cpu")
    assert "--procs" in plan.note


def test_the_default_with_cuda_is_every_gpu(monkeypatch):
    no_cuda(monkeypatch, count=4)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    plan = plan_worlds()
    assert (plan.backend, plan.world_sizes, plan.device_type) == ("nccl", (4,), "cuda")
