"""A lever is a change of the run's fields (``kasoku.advisor.levers.Lever.change``): its
arguments, made from the change by ``kasoku.core.flags``, are the ones each lever had when it
was written as flags; a ``profile.json`` written then (its levers and experiments with only
``args``) reads back as the same changes; the printed texts are as they were."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kasoku.accel.config import AccelConfig
from kasoku.advisor import levers as lv
from kasoku.advisor.levers import Lever
from kasoku.advisor.saved import judge_saved
from kasoku.advisor.verdict import Experiment, Verdict
from kasoku.commands.bench.rung_advice import lever_settings
from kasoku.perf.profile.figures import StepFigures

FIXTURES = Path(__file__).parent / "fixtures" / "verdicts"

KINDS = [  # each kind of lever and experiment: its change, and the arguments it had
    ({"accel.compile": True}, ("--compile",)),
    ({"accel.precision": "bf16"}, ("--precision", "bf16")),
    ({"accel.channels_last": True}, ("--channels-last",)),
    ({"accel.cuda_graph": True}, ("--cuda-graph",)),
    ({"accel.fused_bn": True}, ("--fused-bn",)),
    ({"accel.keep_memory": True}, ("--keep-memory",)),
    ({"accel.activation_checkpointing": "selective"},
     ("--activation-checkpointing", "selective")),
    ({"accel.sdpa_backend": "auto"}, ("--sdpa-backend", "auto")),
    ({"train.loader": "device"}, ("--loader", "device")),
    ({"train.loader": "gpu-jpeg"}, ("--loader", "gpu-jpeg")),
    ({"train.loader": "multiprocess"}, ("--loader", "multiprocess")),
    ({"train.threads": 1}, ("--threads", "1")),
    ({"train.batch_size": 256}, ("--batch-size", "256")),
    ({"train.optimizer": "momentum"}, ("--optimizer", "momentum")),
    ({"dist.allreduce_dtype": "bf16"}, ("--allreduce-dtype", "bf16")),
    ({"kfac.inv_update_freq": 20}, ("--kfac-inv-update-freq", "20")),
    ({"kfac.factor_update_freq": 2}, ("--kfac-factor-update-freq", "2")),
    ({"kfac.method": "inverse"}, ("--kfac-method", "inverse")),
    ({"data.synthetic": True}, ("--synthetic",)),
    ({"data.synthetic": True, "data.synthetic_train_size": 512, "train.loader": "device"},
     ("--synthetic", "--synthetic-size", "512", "--loader", "device")),
    # a script's levers (kasoku profile --with)
    ({"with.workers": 4}, ("--with", "workers=4")),
    ({"with.threads": 2}, ("--with", "threads=2")),
    ({"with.bf16": True}, ("--with", "bf16")),
    ({"with.tf32": True}, ("--with", "tf32")),
    ({"with.cudnn_benchmark": True}, ("--with", "cudnn-benchmark")),
    ({"with.pin_memory": True}, ("--with", "pin-memory")),
    ({"with.replay": True}, ("--with", "replay")),
    ({"with.persistent_workers": True}, ("--with", "persistent-workers")),
    ({"with.prefetch": 4}, ("--with", "prefetch=4")),
    ({"with.allocator": "jemalloc"}, ("--with", "allocator=jemalloc")),
    ({"with.expandable_segments": True}, ("--with", "expandable-segments")),
]


@pytest.mark.parametrize("change, args", KINDS)
def test_a_levers_change_gives_the_arguments_it_had(change, args):
    lever = Lever("text", "estimate: unknown", change, None, "caveat")
    assert lever.args == args
    assert Experiment("label", change, True).args == args
    # profile.json keeps the arguments, and reads back the same lever
    saved = json.loads(json.dumps(lever.to_dict()))
    assert saved["args"] == list(args) and Lever.from_dict(saved) == lever


@pytest.mark.parametrize("change, args", KINDS)
def test_a_profile_written_with_arguments_only_reads_back_as_the_change(change, args):
    old = {"text": "text", "expect": "estimate: unknown", "args": list(args), "speedup": 1.5,
           "caveat": "", "measured": None}
    lever = Lever.from_dict(old)
    assert dict(lever.change).keys() == change.keys() and lever.args == args
    assert {k: v for k, v in lever.to_dict().items() if k != "change"} == old


def test_a_lever_is_frozen_and_its_change_immutable():
    lever = Lever("t", "e", {"accel.compile": True})
    assert lever.change == (("accel.compile", True),)
    assert hash(lever) == hash(Lever("t", "e", (("accel.compile", True),)))
    assert Lever("none", "e").args == () and not Lever("none", "e").change


def test_an_old_verdict_reads_back_with_its_experiments_as_changes():
    old = {"rule": "host-bound", "reason": "r", "line": "l",
           "lever": {"text": "capture the step as a CUDA graph: --cuda-graph",
                     "expect": "estimate ~2.0x", "args": ["--cuda-graph"], "speedup": 2.0},
           "candidates": [], "tried": [], "secondary": [],
           "experiments": [{"label": "synthetic data", "args": ["--synthetic"],
                            "faster": False},
                           {"label": "batch x2 (200)", "args": ["--batch-size", "200"],
                            "faster": True}]}
    v = Verdict.from_dict(old)
    assert v.lever.change == (("accel.cuda_graph", True),)
    assert [dict(e.change) for e in v.experiments] == [{"data.synthetic": True},
                                                       {"train.batch_size": "200"}]
    again = v.to_dict()
    assert [{k: e[k] for k in ("label", "args", "faster")} for e in again["experiments"]] \
        == old["experiments"]
    assert again["lever"]["args"] == ["--cuda-graph"]


def test_the_corpus_levers_say_what_they_said():
    """The texts of the corpus' levers and experiments, as printed before levers were
    changes."""
    texts = set()
    for path in sorted(FIXTURES.glob("*.json")):
        v = judge_saved(json.loads(path.read_text())["figures"])
        texts |= {c.text for c in v.candidates} | {e.label for e in v.experiments}
    assert texts == {
        "NHWC convolutions: --channels-last", "batch x2 (2)", "batch x2 (200)",
        "batch x2 (32)", "batch x2 (512)", "batch x2 (4096)", "batch x2 per worker",
        # the GPU profiles judged against each kernel class's limit (2026-11-28)
        "attention 3.0 ms above its limit: --sdpa-backend flash",
        "capture the step as a CUDA graph: --cuda-graph",
        "fewer operators to dispatch: --compile", "fewer, fused kernels to launch: --compile",
        "fuse the element-wise operators: --compile",
        "fused operators around the matrix products: --compile", "fused operators: --compile",
        "keep freed memory instead of returning it to the OS: --keep-memory",
        "load in worker processes: --loader multiprocess",
        "more work per exchange (the same all-reduce over twice the samples): --batch-size 200",
        "more work per launch: --batch-size 200", "more work per operator: --batch-size 2",
        "more work per operator: --batch-size 200",
        "one thread (small operators spend their time synchronizing threads): --threads 1",
        "synthetic data", "synthetic data on the device", "tensor cores in bf16: --precision bf16",
        "the AVX512-BF16 units of this CPU: --precision bf16",
        "the base optimizer alone (--optimizer momentum)",
        "the dataset resident on the GPU: --loader device",
        "update K-FAC's factors half as often: --kfac-factor-update-freq 2"}


def test_the_texts_outside_the_corpus_say_what_they_said():
    f = StepFigures(device="cuda", batch_size=100, has_conv=True, has_blocks=True,
                    data_kind="image-folder", loader="serial", allreduce_dtype="fp32")
    texts = [lever.text for lever in
             lv.input_candidates(f) + lv.communication_candidates(f)
             + lv.gpu_memory_candidates(f, AccelConfig(compile=True, channels_last=True))
             + lv.memory_full_candidates(f, AccelConfig())
             + lv.attention_candidates(f, AccelConfig(sdpa_backend="math"))]
    texts += [lv.input_fallback(f).text, lv.memory_full_fallback(f).text,
              lv.attention_fallback(f).text]
    assert texts == [
        "decode the JPEGs on the GPU: --loader gpu-jpeg",
        "load in worker processes: --loader multiprocess",
        "more work per exchange (the same all-reduce over twice the samples): --batch-size 200",
        "all-reduce the gradients in bf16: --allreduce-dtype bf16",
        "batch norm + ReLU as kasoku's fused kernels: --fused-bn",
        "half the bytes per activation: --precision bf16",
        "keep fewer activations: --activation-checkpointing selective",
        "keep fewer activations: --activation-checkpointing full",
        "a fused attention kernel: --sdpa-backend auto",
        "more loader workers (--loader KIND:N), smaller images, or faster storage",
        "shard the weights, gradients and optimizer state over several GPUs (FSDP2: --gpus N "
        "--shard), or a smaller batch",
        "attention through scaled_dot_product_attention (gpt: --attention sdpa), its flash or "
        "memory-efficient kernel (--sdpa-backend auto)"]


def test_the_kfac_levers_say_what_they_said():
    k = {"phases_pct": {"kfac_factors": 1.0, "kfac_inverse": 50.0, "kfac_precondition": 1.0},
         "method": "eigen", "inv_update_freq": 10, "factor_update_freq": 1}
    inverse = lv.kfac_lever(StepFigures(kfac=k))
    assert inverse.text == ("update K-FAC's inverses half as often: --kfac-inv-update-freq 20 "
                            "(or --kfac-method inverse: Cholesky inverses)")
    k["phases_pct"] = {"kfac_factors": 1.0, "kfac_inverse": 1.0, "kfac_precondition": 50.0}
    method = lv.kfac_lever(StepFigures(kfac=k))
    assert method.text == "precondition with the factors' inverses: --kfac-method inverse"
    assert method.args == ("--kfac-method", "inverse")


@pytest.mark.parametrize("lever, settings", [
    ({"args": ["--precision", "bf16", "--channels-last"]},
     {"precision": "bf16", "channels_last": True}),
    ({"args": ["--compile"], "change": {"accel.compile": True}}, {"compile": True}),
    ({"args": ["--loader", "device"]}, {}),  # not a rung's setting
    ({"args": []}, {}),
])
def test_a_rungs_advice_reads_the_levers_settings(lever, settings):
    assert lever_settings(lever) == settings
