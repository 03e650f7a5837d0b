"""The trace analysis and every rule of the verdict table, on constructed traces (Chrome-trace
events as torch.profiler writes them): each scenario is built so one bottleneck holds, and the
analysis must find it with the right numbers. The CPU's rules: tests/test_profile_verdict_cpu.py."""
from __future__ import annotations

import pytest

from kasoku.advisor.saved import judge_saved
from kasoku.advisor.verdict import RULES
from kasoku.perf.profile import trace


class Builder:
    """Chrome-trace events: host phase spans, launches and the kernels they launch."""

    def __init__(self):
        self.events, self.corr = [], 0

    def phase(self, name, ts, dur):
        self.events.append({"ph": "X", "cat": "user_annotation", "name": f"kasoku/{name}",
                            "ts": ts, "dur": dur, "tid": 1})

    def op(self, name, ts, dur):
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur,
                            "tid": 1})

    def launch(self, ts, name="cudaLaunchKernel"):
        self.corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 4,
                            "tid": 1, "args": {"correlation": self.corr}})
        return self.corr

    def kernel(self, corr, name, ts, dur):
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                            "tid": 7, "args": {"correlation": corr}})

    def sync(self, ts, dur):
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                            "ts": ts, "dur": dur, "tid": 1, "args": {"correlation": 0}})

    def steps(self, n, step_us, body):
        """``n`` steps of ``step_us``: a data span then ``body(self, t0)`` for the rest."""
        for i in range(n):
            body(self, i * step_us)
        return trace.parse(self.events)


def figures(t, **context):
    f = trace.analyse(t, samples_per_step=100)
    f.update(batch_size=100, **context)
    return f


def gpu_step(data_us=10, kernel="sm90_xmma_gemm", n_kernels=8, kernel_us=100,
             launch_gap_us=None, phases=True):
    """A step body: data wait, then ``n_kernels`` kernels. ``launch_gap_us`` None: all
    launched at once up front (the device runs them back to back); else one launch every
    ``launch_gap_us`` with the kernel starting 5 us after its launch (a host too slow to keep
    the device fed)."""
    def body(b, t0):
        b.phase("data", t0, data_us)
        t = t0 + data_us
        b.phase("forward", t, 1000 - data_us)
        k_start = t + 5
        for i in range(n_kernels):
            if launch_gap_us is None:
                c = b.launch(t + i)
                b.kernel(c, kernel, k_start + i * kernel_us, kernel_us)
            else:
                c = b.launch(t + i * launch_gap_us)
                b.kernel(c, kernel, t + i * launch_gap_us + 5, kernel_us)
    return body


def test_input_bound_gpu():
    # 600 us of each 1000 us step the host is in the loader while the device sits idle.
    t = Builder().steps(5, 1000, gpu_step(data_us=600, n_kernels=3, kernel_us=100))
    f = figures(t, device="cuda", config={"precision": "bf16"}, loader="serial")
    assert f["data_pct"] == pytest.approx(60, abs=2)
    v = judge_saved(f)
    assert v.rule == "input-bound"
    assert "--loader multiprocess" in v.lever.text
    assert v.experiments[0].args == ("--synthetic", "--synthetic-size", "600", "--loader",
                                     "device")
    assert v.experiments[0].faster


def test_host_bound_gpu_suggests_cuda_graph():
    # A 20 us kernel every 50 us: the device waits for each launch.
    t = Builder().steps(5, 1000, gpu_step(n_kernels=19, kernel_us=20, launch_gap_us=50))
    f = figures(t, device="cuda", config={"precision": "bf16", "cuda_graph": False})
    assert f["busy_pct"] == pytest.approx(38, abs=3)
    assert f["idle_host_pct"] > 50
    assert f["launches_per_step"] == 19 and f["kernels_per_step"] == 19
    v = judge_saved(f)
    assert v.rule == "host-bound"
    assert v.lever.args == ("--cuda-graph",)
    assert "launches/step" in v.reason
    assert [e.faster for e in v.experiments] == [False, True]


def test_a_host_bound_sharded_step_is_never_told_to_graph():
    """FSDP2 refuses --cuda-graph (measured on 2 H200s: GPT-2 small under FSDP2, host 92 ms
    against device 47 ms per step, was advised --cuda-graph): a bigger batch first."""
    t = Builder().steps(5, 1000, gpu_step(n_kernels=19, kernel_us=20, launch_gap_us=50))
    v = judge_saved(figures(t, device="cuda", config={"precision": "bf16"}, sharded=True))
    assert v.rule == "host-bound"
    assert [c.args for c in v.candidates] == [("--batch-size", "200"), ("--compile",)]
    assert not any("--cuda-graph" in c.args for c in v.candidates)


def test_data_wait_smaller_than_launch_wait_is_host_bound():
    """A host too slow to launch also waits in its loader; the larger cause is the verdict."""
    t = Builder().steps(5, 1000, gpu_step(data_us=200, n_kernels=15, kernel_us=20,
                                          launch_gap_us=50))
    f = figures(t, device="cuda", config={})
    assert f["data_pct"] == pytest.approx(20, abs=2) and f["idle_host_pct"] > 40
    v = judge_saved(f)
    assert v.rule == "host-bound"
    assert not any(s.startswith("input-bound") for s in v.secondary)
    assert v.secondary == ["20% of the step waiting for data"]  # named, below the rule
    # Synthetic data would not prove this bound: the 20% wait alone would make it faster.
    assert [e.label for e in v.experiments] == ["batch x2 (200)"]


def test_host_to_device_copies_are_counted_and_their_source_named():
    def body(b, t0):
        gpu_step(data_us=100, n_kernels=4)(b, t0)
        c = b.launch(t0 + 100, name="cudaMemcpyAsync")
        b.events.append({"ph": "X", "cat": "gpu_memcpy", "name":
                         "Memcpy HtoD (Pageable -> Device)", "ts": t0 + 110, "dur": 50,
                         "tid": 7, "args": {"correlation": c}})
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={})
    assert f["h2d_ms"] == pytest.approx(0.05) and f["h2d_pageable"]
    f = figures(Builder().steps(5, 1000, gpu_step()), device="cuda", config={})
    assert f["h2d_ms"] == 0 and not f["h2d_pageable"]


def test_host_bound_with_graph_suggests_compile_then_a_larger_batch():
    t = Builder().steps(5, 1000, gpu_step(n_kernels=19, kernel_us=20, launch_gap_us=50))
    v = judge_saved(figures(t, device="cuda", config={"cuda_graph": True}))
    assert v.rule == "host-bound" and v.lever.args == ("--compile",)
    assert [c.args for c in v.candidates] == [("--compile",), ("--batch-size", "200")]
    assert v.lever.expect.startswith("estimate")  # not measured: said so
    done = judge_saved(figures(t, device="cuda", config={"cuda_graph": True, "compile": True}))
    assert done.lever.args == ("--batch-size", "200") and "learning rate" in done.lever.caveat
    assert [(e.label.split(" ")[0], e.faster) for e in done.experiments] == \
        [("synthetic", False), ("batch", True)]


def test_compute_bound_fp32_suggests_bf16_then_nothing():
    t = Builder().steps(5, 1000, gpu_step(n_kernels=9, kernel_us=108))
    f = figures(t, device="cuda", config={"precision": "fp32"}, has_conv=True, mfu=0.31)
    assert f["busy_pct"] > 95 and f["idle_host_pct"] < 3
    assert f["by_kind_pct"]["conv/matmul"] == pytest.approx(100)
    v = judge_saved(f)
    assert v.rule == "device-bound (compute-bound)" and "MFU 31%" in v.reason
    assert v.lever.args == ("--precision", "bf16")
    done = judge_saved({**f, "config": {"precision": "bf16", "channels_last": True}})
    assert done.lever.args == () and "no cheap lever" in done.lever.text
    # Nothing to apply: the proof is that neither synthetic data nor a larger batch help.
    assert [(e.label.split(" ")[0], e.faster) for e in done.experiments] == \
        [("synthetic", False), ("batch", False)]


def test_memory_bound_suggests_compile():
    t = Builder().steps(5, 1000, gpu_step(kernel="triton_poi_fused_relu_0", n_kernels=9,
                                          kernel_us=108))
    v = judge_saved(figures(t, device="cuda", config={"compile": False}))
    assert v.rule == "device-bound (memory-bound)" and v.lever.args == ("--compile",)
    assert [c.args for c in v.candidates] == [("--compile",), ("--precision", "bf16")]
    assert [e.faster for e in v.experiments] == [False, False]
    done = judge_saved(figures(t, device="cuda", config={"compile": True, "precision": "bf16"}))
    assert done.lever.args == () and "triton" in done.lever.text
    assert [(e.label.split(" ")[0], e.faster) for e in done.experiments] == \
        [("synthetic", False), ("batch", False)]


def test_busy_with_tiny_kernels_is_latency_bound():
    # 180 kernels of 5 us back to back: busy 90%, but none long enough to fill the GPU
    # (a small MLP's step captured as a CUDA graph).
    t = Builder().steps(5, 1000, gpu_step(n_kernels=180, kernel_us=5))
    f = figures(t, device="cuda", config={"cuda_graph": True, "compile": True}, mfu=0.01)
    assert f["busy_pct"] == pytest.approx(90, abs=2)
    v = judge_saved(f)
    assert v.rule == "device-bound (latency-bound)"
    assert "180 kernels per step average 5.0 us" in v.reason
    assert v.lever.args == ("--batch-size", "200")
    assert [(e.args[0], e.faster) for e in v.experiments] == [("--synthetic", False),
                                                             ("--batch-size", True)]
    # The same busy share in 50 us kernels is a device that is full.
    t = Builder().steps(5, 1000, gpu_step(n_kernels=18, kernel_us=50))
    assert judge_saved(figures(t, device="cuda", config={"cuda_graph": True, "compile": True})
                 ).rule == "device-bound (compute-bound)"


def test_communication_bound():
    def body(b, t0):
        gpu_step(n_kernels=4, kernel_us=100)(b, t0)
        c = b.launch(t0 + 20)
        b.kernel(c, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 420, 500)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={})
    assert f["comm_pct"] == pytest.approx(50, abs=3)
    assert judge_saved(f).rule == "communication-bound"
    assert [c.args for c in judge_saved(f).candidates] == [("--batch-size", "200"),
                                                           ("--allreduce-dtype", "bf16")]


def test_collectives_on_two_streams_at_once_count_once():
    # Two all-reduces overlapping on two streams: 500 us of wall time, not 800.
    def body(b, t0):
        gpu_step(n_kernels=4, kernel_us=100)(b, t0)
        for start in (420, 720):
            c = b.launch(t0 + 20)
            b.kernel(c, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + start, 400 if
                     start == 420 else 200)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={})
    assert f["comm_pct"] == pytest.approx(50, abs=3) and f["comm_pct"] <= 100


def test_communication_bound_confirms_with_a_doubled_batch():
    def body(b, t0):
        gpu_step(n_kernels=4, kernel_us=100)(b, t0)
        c = b.launch(t0 + 20)
        b.kernel(c, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 420, 500)
    v = judge_saved(figures(Builder().steps(5, 1000, body), device="cuda", config={}))
    assert [(e.label, e.args, e.faster) for e in v.experiments] == [
        ("batch x2 per worker", ("--batch-size", "200"), True)]


def test_gloo_collectives_on_their_threads_count_on_a_cpu():
    """gloo runs the all-reduce on its own threads, recorded as ``gloo:all_reduce`` spans;
    overlapping spans of two threads count once."""
    def body(b, t0):
        cpu_step(op_us=400, ops=4)(b, t0)
        for tid, start in ((8, 300), (9, 350)):
            b.events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce",
                             "ts": t0 + start, "dur": 400, "tid": tid})
    f = figures(Builder().steps(5, 1000, body), device="cpu", config={})
    assert f["comm_pct"] == pytest.approx(45, abs=1)  # 300..750 of each 1,000 us step
    assert f["comm_ms"] == pytest.approx(0.45, abs=0.01)
    assert judge_saved(f).rule == "communication-bound"


def test_graph_replay_gaps_are_not_launch_waits():
    """All kernels of one replay carry the graph launch's correlation id: their gaps are
    inside the graph (other), not waits for the host -- the case HTA misreads."""
    def body(b, t0):
        b.phase("data", t0, 10)
        b.phase("compute", t0 + 10, 990)
        c = b.launch(t0 + 12, name="cudaGraphLaunch")
        for i in range(10):  # 60 us kernels with 40 us gaps between them
            b.kernel(c, "sm90_xmma_gemm", t0 + 20 + 100 * i, 60)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={"cuda_graph": True})
    assert f["idle_host_pct"] < 5
    assert f["idle_other_pct"] > 30
    assert f["graph_replays_per_step"] == 1 and f["launches_per_step"] == 1
    assert f["kernels_per_step"] == 10


def test_late_graph_launch_is_a_host_wait():
    def body(b, t0):
        b.phase("data", t0, 10)
        b.phase("compute", t0 + 10, 990)
        c = b.launch(t0 + 500, name="cudaGraphLaunch")  # the host launched late
        for i in range(4):
            b.kernel(c, "sm90_xmma_gemm", t0 + 505 + 100 * i, 100)
    f = figures(Builder().steps(5, 1000, body), device="cuda", config={"cuda_graph": True})
    # Idle from the previous replay's end (905 us into its step) to 505 us into this one,
    # less the 10 us data wait.
    assert f["idle_host_pct"] == pytest.approx(59, abs=3)


def test_phases_of_device_time_follow_the_launching_span():
    def body(b, t0):
        b.phase("data", t0, 10)
        b.phase("forward", t0 + 10, 300)
        b.phase("backward", t0 + 310, 600)
        b.phase("update", t0 + 910, 90)
        for ts, dur in ((t0 + 20, 200), (t0 + 320, 400), (t0 + 920, 50)):
            b.kernel(b.launch(ts), "k", ts + 5, dur)
    f = figures(Builder().steps(4, 1000, body), device="cuda", config={})
    assert f["phases_device_ms"] == pytest.approx({"forward": 0.2, "backward": 0.4,
                                                   "update": 0.05})


def cpu_step(data_us=10, op_us=900, ops=9):
    def body(b, t0):
        b.phase("data", t0, data_us)
        b.phase("forward", t0 + data_us, 1000 - data_us)
        each = op_us / ops
        for i in range(ops):
            b.op("aten::addmm", t0 + data_us + i * each, each)
    return body


def kfac_context(method="eigen", factor_update_freq=1, inv_update_freq=10, **seconds):
    """``kfac_figures`` of a real K-FAC optimizer and phases of ``seconds`` per phase."""
    from kfac_cases import kfac_of, tiny

    from kasoku.core.phases import summarize
    from kasoku.kfac import KFACConfig
    from kasoku.perf.profile.kfac_cost import kfac_figures
    opt = kfac_of(tiny()[0], KFACConfig(method=method, factor_update_freq=factor_update_freq,
                                        inv_update_freq=inv_update_freq))
    return kfac_figures(summarize(seconds, 1), opt, steps=20)


def test_kfac_bound_names_its_share_and_halves_its_costliest_steps():
    f = figures(Builder().steps(4, 1000, cpu_step()), device="cpu", config={},
                peak_fraction=0.5)
    f.update(kfac_context(forward=0.0035, backward=0.0035, kfac_factors=0.0007,
                          kfac_inverse=0.0016, kfac_precondition=0.0007))
    assert f["kfac_pct"] == pytest.approx(30) and f["kfac"]["without_ms"] == pytest.approx(7)
    v = judge_saved(f)
    assert v.rule == "kfac-bound"
    assert v.reason.startswith("K-FAC's curvature work is 30% of the step (factors 7%, "
                               "inverse 16%, precondition 7%)")
    assert v.lever.args == ("--kfac-inv-update-freq", "20") and "--kfac-method inverse" in \
        v.lever.text
    assert v.lever.speedup == pytest.approx(1 / 0.92)
    assert [c.args for c in v.candidates] == [("--kfac-inv-update-freq", "20")]
    assert [(e.args, e.faster) for e in v.experiments] == [
        (("--optimizer", "momentum"), True)]  # the step without K-FAC's 30%: 1.43x
    assert v.secondary[0].startswith("compute-bound: ")
    factors = judge_saved({**f, **kfac_context(factor_update_freq=2, forward=0.002,
                                               kfac_factors=0.004, kfac_inverse=0.001)})
    assert factors.lever.args == ("--kfac-factor-update-freq", "4")
    assert factors.lever.speedup == pytest.approx(1 / (1 - 0.57 / 2), rel=0.01)
    precondition = dict(forward=0.002, kfac_precondition=0.003)
    assert judge_saved({**f, **kfac_context(**precondition)}).lever.args == (
        "--kfac-method", "inverse")
    inverse = judge_saved({**f, **kfac_context(method="inverse", **precondition)})
    assert inverse.lever.args == () and [e.args for e in inverse.experiments] == [
        ("--optimizer", "momentum")]


def test_a_smaller_kfac_share_is_named_as_secondary():
    f = figures(Builder().steps(4, 1000, cpu_step(data_us=500, op_us=400)), device="cpu",
                config={}, loader="serial")
    f.update(kfac_context(forward=0.0085, kfac_inverse=0.0015))
    named = "15% of the step in K-FAC's curvature work (factors, inverses, preconditioning)"
    assert judge_saved(f).rule == "input-bound" and named in judge_saved(f).secondary
    assert named not in judge_saved({**f, **kfac_context(forward=0.0095, kfac_inverse=0.0005)}
                                    ).secondary


def test_every_rule_is_exercised():
    """The table and this file move together: a new rule needs a scenario above (the
    transformer's, memory-full and attention-unfused: tests/test_transformer_verdict.py)."""
    assert sorted({r.name for r in RULES}) == ["attention-unfused", "communication-bound",
                                                 "compute-bound", "dispatch-bound",
                                                 "host-bound", "input-bound", "kfac-bound",
                                                 "latency-bound", "memory-bound",
                                                 "memory-full"]


def test_a_trace_without_steps_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        trace.analyse(trace.parse([]))


def test_a_second_cause_is_named_with_its_numbers():
    f = {"device": "cuda", "data_pct": 40.0, "comm_pct": 25.0, "idle_host_pct": 12.0,
         "busy_pct": 50.0, "loader": "serial", "batch_size": 64}
    v = judge_saved(f)
    assert v.rule == "input-bound"
    assert v.secondary == ["communication-bound: collectives (all-reduce) take 25% of the step",
                           "12% of the step the device waiting for launches"]
    assert judge_saved(dict(f, comm_pct=5.0, idle_host_pct=3.0)).secondary == []

