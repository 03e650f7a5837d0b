"""kasoku bench's parts in-process: rungs and --config parsing, the numerics checks, the
batch pool, timing, and one worker run (plain, kasoku, simulated OOM)."""
import math
import sys
from dataclasses import replace

import pytest
import torch

from kasoku.accel.config import AccelConfig
from kasoku.cli import build_parser
from kasoku.cli.bench import run as cmd_bench
from kasoku.commands.bench import numerics, worker
from kasoku.commands.bench.pool import batch_spec, cycle, make_pool
from kasoku.commands.bench.process import run_process as _run_process
from kasoku.commands.bench.rungs import (
    PLAIN,
    Rung,
    compute_dtype,
    cpu_ladder,
    default_ladder,
    gpu_ladder,
    parse_config,
    resolve,
    rung_from_spec,
)
from kasoku.commands.bench.sweep import SweepConfig, SweepResult, _run_worker
from kasoku.commands.bench.timing import measure_windows
from kasoku.core.errors import ConfigError
from kasoku.workloads import create_workload


def test_a_transformer_climbs_its_own_gpu_ladder(monkeypatch):
    """gpt's GPU ladder has no conv levers; each rung adds one lever; float8 tops it, skipped
    (with the reason) where torchao is missing; the CPU ladder is the same for every model."""
    from kasoku.commands.bench import rungs as rungs_module
    monkeypatch.setattr(rungs_module, "has_torchao", lambda: True)
    ladder = default_ladder("cuda", create_workload("gpt").ladder)
    assert [r.label for r in ladder] == ["plain", "fp32", "tf32", "amp", "+fused", "+compile",
                                         "+cuda-graph", "+float8"]
    c = {r.label: r.config for r in ladder[1:]}
    for before, after in zip(ladder[1:-1], ladder[2:]):
        changed = {k for k, v in vars(after.config).items() if vars(before.config)[k] != v}
        assert len(changed - {"compile_mode"}) == 1, (after.label, changed)
    assert c["+float8"].float8 == "tensorwise" and c["+float8"].cuda_graph
    assert ladder[-1].skip is None
    monkeypatch.setattr(rungs_module, "has_torchao", lambda: False)
    assert "torchao" in default_ladder("cuda", "transformer")[-1].skip
    assert rung_from_spec("+float8", "cuda", "transformer").skip is None  # asked: measured
    assert default_ladder("cpu", "transformer") == cpu_ladder()
    assert create_workload("mnist-mlp").ladder == "default"


def test_gpu_ladder_adds_one_lever_per_rung():
    ladder = gpu_ladder()
    assert [r.label for r in ladder] == ["plain", "fp32", "tf32", "amp", "+channels_last",
                                         "+fused", "+compile", "+cuda-graph", "+fused-bn",
                                         "+fast-stem", "+combo-kernels", "+matmul-1x1",
                                         "+wgrad-stream"]
    assert ladder[0] is PLAIN and ladder[0].config is None
    c = {r.label: r.config for r in ladder[1:]}
    assert c["fp32"] == AccelConfig(precision="fp32", optimizer_impl="foreach")
    assert c["tf32"].precision == "tf32" and c["tf32"].cudnn_benchmark
    assert not c["fp32"].cudnn_benchmark
    assert c["amp"].precision == "bf16" and not c["amp"].channels_last
    assert c["+channels_last"].channels_last and c["+channels_last"].optimizer_impl == "foreach"
    assert c["+fused"].optimizer_impl == "fused" and not c["+fused"].compile
    assert c["+compile"].compile and not c["+compile"].cuda_graph
    assert c["+cuda-graph"].cuda_graph and c["+cuda-graph"].compile
    assert not c["+cuda-graph"].fused_bn and not c["+fused-bn"].fast_stem
    assert c["+fused-bn"] == replace(c["+cuda-graph"], fused_bn=True)
    assert c["+fast-stem"] == replace(c["+fused-bn"], fast_stem=True)
    assert c["+combo-kernels"] == replace(c["+fast-stem"], combo_kernels=True)
    assert c["+matmul-1x1"] == replace(c["+combo-kernels"], matmul_1x1=True)
    assert c["+wgrad-stream"] == replace(c["+matmul-1x1"], wgrad_stream=True)
    assert [compute_dtype(r) for r in ladder[:4]] == ["fp32", "fp32", "tf32", "bf16"]


def test_cpu_ladder_and_levers_that_do_not_apply():
    ladder = cpu_ladder()
    assert [r.label for r in ladder] == ["plain", "fp32", "+fused", "+keep-memory", "+bf16",
                                         "+channels_last", "+compile"]
    assert ladder[1].config.optimizer_impl == "loop"  # what torch.optim picks on a CPU
    assert ladder[2].config.optimizer_impl == "fused"
    assert ladder[3].config.keep_memory and not ladder[2].config.keep_memory
    rungs, notes = resolve(ladder, "cpu", has_conv=False)
    assert [r.label for r in rungs] == ["plain", "fp32", "+fused", "+keep-memory", "+bf16",
                                        "+compile"]
    assert not rungs[-1].config.channels_last
    assert sum("channels_last does not apply" in n for n in notes) == 1
    assert any("+channels_last skipped" in n for n in notes)
    rungs, notes = resolve(gpu_ladder(), "cpu", has_conv=True)
    assert "tf32" not in [r.label for r in rungs] and "+cuda-graph" not in [r.label for r in rungs]
    assert "+wgrad-stream" not in [r.label for r in rungs]
    for lever in ("tf32", "cudnn_benchmark", "cuda_graph", "wgrad_stream"):
        assert sum(n.startswith(f"{lever} does not apply") for n in notes) == 1, notes
    assert all(not r.config.cudnn_benchmark for r in rungs if r.config)
    rungs, notes = resolve(gpu_ladder(), "cuda", has_conv=True)
    assert rungs == gpu_ladder() and notes == []


def test_an_mlp_on_the_gpu_ladder_runs_every_rung_it_can():
    """The conv-only levers are dropped, so no rung is refused by check_config (fused_bn
    without channels_last was: seen on an H200 with mnist-mlp)."""
    from kasoku.accel.compose import check_config
    rungs, notes = resolve(gpu_ladder(), "cuda", has_conv=False)
    labels = [r.label for r in rungs]
    assert "+fused-bn" not in labels and "+fast-stem" not in labels
    assert "+combo-kernels" in labels and "+cuda-graph" in labels
    for rung in rungs:
        if rung.config is not None:
            check_config(rung.config)
            assert not (rung.config.fused_bn or rung.config.fast_stem
                        or rung.config.channels_last or rung.config.matmul_1x1)
    for lever in ("fused_bn", "fast_stem", "channels_last", "matmul_1x1", "wgrad_stream"):
        assert sum(n.startswith(f"{lever} does not apply") for n in notes) == 1, notes


def test_parse_config():
    c = parse_config("precision=bf16,channels_last,compile=max-autotune")
    assert c == AccelConfig(precision="bf16", channels_last=True, compile=True,
                            compile_mode="max-autotune")
    c = parse_config("fp16, fused, cuda-graph, loss_scale_init=1024, cudnn_benchmark=off")
    assert (c.precision, c.optimizer_impl, c.cuda_graph, c.loss_scale_init,
            c.cudnn_benchmark) == ("fp16", "fused", True, 1024.0, False)
    assert parse_config("compile").compile_mode == "default"
    # A bare precision with a hyphen is a precision, not a key spelled with "_".
    assert parse_config("fp16-pure,fused").precision == "fp16-pure"
    with pytest.raises(ConfigError, match="unknown bench config key 'colour'.*precision"):
        parse_config("colour=red")
    for bad in ("precision=fp8", "compile=fastest", "channels_last=maybe",
                "loss_scale_init=big", "optimizer_impl=turbo", "precision"):
        with pytest.raises(ConfigError):
            parse_config(bad)
    assert rung_from_spec("amp", "cuda") == gpu_ladder()[3]
    assert rung_from_spec("plain", "cpu") is PLAIN
    custom = rung_from_spec("precision=bf16,channels_last", "cpu")
    assert custom.label == "precision=bf16,channels_last" and custom.config.channels_last


def test_numerics_checks():
    ref = [2.3, 2.2, 2.1, 2.0]
    assert numerics.check(ref, None, "fp32", is_reference=True).status == "ok"
    ok = numerics.check([2.3, 2.25, 2.15, 2.05], ref, "bf16")
    assert ok.status == "ok" and ok.rel_diff < 0.05 and ok.tolerance == 0.05
    off = numerics.check([2.3, 2.6, 2.7, 2.8], ref, "bf16")
    assert off.failed and "tolerance 5%" in off.reason
    assert numerics.check([2.3, 2.25, 2.15, 2.05], ref, "fp32").failed  # 1.8% > 1%
    nan = numerics.check([2.3, math.nan, 2.0, 2.0], ref, "bf16")
    assert nan.failed and "step 2" in nan.reason
    assert numerics.check([2.3, 2.2, 2.1, 2.0], None, "tf32").status == "n/a"
    assert numerics.check(None, ref, "fp32").status == "n/a"
    assert numerics.TOLERANCES == {"fp32": 0.01, "tf32": 0.02, "bf16": 0.05, "fp16": 0.05,
                                   "fp16-pure": 0.05}


def test_pool_has_the_workloads_shapes_and_is_seeded():
    wl = create_workload("mnist-mlp")
    spec = batch_spec(wl, wl.build_model())
    assert spec.describe() == {"input_shape": [1, 28, 28], "input_dtype": "float32",
                               "input_range": "unit", "target": "classes:10"}
    pool = make_pool(spec, 16, torch.device("cpu"), num_batches=3, seed=1)
    assert len(pool) == 3
    for x, y in pool:
        assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32
        assert 0 <= float(x.min()) and float(x.max()) <= 1
        assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 10
    again = make_pool(spec, 16, torch.device("cpu"), num_batches=3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(pool, again))
    assert [id(b) for b in cycle(pool, 5, 2)] == [id(pool[i % 3]) for i in range(2, 7)]
    lstm = create_workload("sine-lstm")
    s = batch_spec(lstm, lstm.build_model())
    assert s.num_classes is None and s.input_range == "normal"
    x, y = s.make_batch(4, torch.device("cpu"))
    assert y.dtype == torch.float32 and y.shape[0] == 4


def test_measure_windows_counts_samples():
    calls = []
    runner = lambda batches: calls.append(len(batches)) or torch.tensor(1.0)  # noqa: E731
    pool = [(torch.zeros(4, 1), torch.zeros(4))]
    m, loss = measure_windows(runner, pool, torch.device("cpu"), 4, steps=5, windows=3)
    assert calls == [5, 5, 5] and len(m.window_s) == 3 and float(loss) == 1.0
    fig = m.figures()
    assert fig["samples_per_s"]["n"] == 3
    assert fig["samples_per_s"]["min"] <= fig["samples_per_s"]["median"] \
        <= fig["samples_per_s"]["max"]


def _request(rung, **kw):
    args = dict(batch_size=8, steps=2, windows=2, warmup=1, numerics_steps=3)
    args.update(kw)
    return worker.WorkerRequest("mnist-mlp", rung, **args)


def test_the_labels_a_config_is_checked_against_are_the_ladders():
    """``rung_spec.LADDER_LABELS`` (read without torch by the command line) names every rung
    of the ladders, the CPU's with and without bf16 hardware, and nothing else."""
    from kasoku.commands.bench.rung_spec import LADDER_LABELS
    from kasoku.commands.bench.rungs import transformer_gpu_ladder
    labels = {r.label for r in gpu_ladder() + transformer_gpu_ladder() + cpu_ladder()}
    assert set(LADDER_LABELS) == labels and len(LADDER_LABELS) == len(labels)


def test_a_workers_request_survives_its_json(tmp_path):
    """What a bench worker is started with, typed both ways: the plain loop (no config), a
    ladder rung, and a loader-fed rung of lever settings."""
    for rung in (PLAIN, cpu_ladder()[2], gpu_ladder()[-1],
                 Rung("bf16,compile", parse_config("bf16,compile"), loader="threads:2")):
        request = _request(rung, device="cuda", threads=3, kernels=4, data=str(tmp_path),
                           loader_cores=False, numerics_only=True)
        assert worker.WorkerRequest.from_json(request.to_json()) == request


def test_worker_plain_and_kasoku_fp32_take_the_same_steps():
    plain = worker.run(_request(PLAIN))
    fp32 = worker.run(_request(cpu_ladder()[1]))
    for rec in (plain, fp32):
        assert rec["status"] == "ok", rec["error"]
        f = rec["figures"]
        # 2 windows, more where they disagreed (the noise rule)
        assert f["samples_per_s"]["n"] == 2 + f["stability"]["extra_windows"]
        assert f["warmup_s"] > 0 and f["mem_peak_gib"] > 0
        assert math.isfinite(f["final_loss"]) and len(rec["numerics"]["losses"]) == 3
        assert rec["data"]["source"] == "synthetic on-device"
    assert fp32["config"]["kind"] == "kasoku" and plain["config"]["kind"] == "plain"
    # Same weights, batches and update rule: kasoku's fp32 step adds nothing to the arithmetic.
    assert fp32["numerics"]["losses"] == pytest.approx(plain["numerics"]["losses"], rel=1e-5)


def test_worker_reports_a_simulated_oom(monkeypatch):
    monkeypatch.setenv(worker.OOM_ENV, "4,8")
    rec = worker.run(_request(PLAIN))
    assert rec["status"] == "oom" and "simulated" in rec["error"]
    assert "samples_per_s" not in rec["figures"]
    monkeypatch.setenv(worker.OOM_ENV, "64")
    assert worker.run(_request(PLAIN, numerics_only=True))["status"] == "ok"


def test_crashing_and_hanging_runs_are_reported(tmp_path):
    status, _, stderr = _run_process([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout"
    status, _, stderr = _run_process([sys.executable, "-c", "raise SystemExit('boom')"], 30)
    assert status == 1 and "boom" in stderr
    # A worker that dies without a report: its status, last line and whole stderr are kept.
    cfg = SweepConfig("no-such-workload", (PLAIN,), (8,), tmp_path, timeout_s=60)
    rec = _run_worker(cfg, PLAIN, 8)
    assert rec["status"] == "error" and "unknown workload" in rec["error"]
    assert "Traceback" in open(rec["log"]).read()
    assert SweepResult([rec]).exit_code == 1


def _bench_args(argv):
    return build_parser().parse_args(["bench", *argv])


def test_bench_arguments_and_their_errors(tmp_path):
    args = _bench_args(["mnist-mlp", "--batch-size", "16,32", "--config", "bf16", "--config",
                        "precision=fp32,fused"])
    assert args.batch_size == [16, 32] and args.config == ["bf16", "precision=fp32,fused"]
    assert args.windows == 3 and args.numerics_steps == 10 and args.handler is cmd_bench
    with pytest.raises(SystemExit):
        _bench_args(["mnist-mlp", "--ladder", "--config", "bf16"])
    for wrong in (["--batch-size", "0,16"], ["--windows", "0"], ["--device", "tpu"],
                  ["--config", "nonsense=1"]):
        with pytest.raises(SystemExit):  # refused where it is parsed
            _bench_args(["mnist-mlp", *wrong])
    bad = [["--device", "cpu", "--report"]]
    if not torch.cuda.is_available():
        bad.append(["--device", "cuda"])
    for extra in bad:
        with pytest.raises(ConfigError):
            cmd_bench(_bench_args(["mnist-mlp", "--out", str(tmp_path / "none"), *extra]))
    with pytest.raises(ConfigError, match="kasoku list"):
        cmd_bench(_bench_args(["no-such-workload", "--device", "cpu"]))
