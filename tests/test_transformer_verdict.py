"""The verdict's transformer bounds (issue 35), on constructed traces as
tests/test_profile_verdict.py builds them: a card that is full (activation checkpointing
first, for a model with blocks), attention that runs unfused, and a small model's
launches."""
from __future__ import annotations

from test_profile_verdict import Builder, figures, gpu_step

from kasoku.advisor.saved import judge_saved
from kasoku.perf.profile.kernels import attention_kind

FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>"
SOFTMAX = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>"
LOG_SOFTMAX = "void at::native::cunn_SoftMaxForward<4, float, LogSoftMaxForwardEpilogue>"


def transformer_step(attention_kernel, attention_us=200, **kw):
    """A busy step of matrix products (``gpu_step``) plus one attention kernel per step."""
    inner = gpu_step(n_kernels=7, kernel_us=100, **kw)

    def body(b, t0):
        inner(b, t0)
        c = b.launch(t0 + 20)
        b.kernel(c, attention_kernel, t0 + 720, attention_us)
    return body


def test_attention_kernels_are_told_apart_by_name():
    assert attention_kind(FLASH) == "fused"
    assert attention_kind("fmha_cutlassF_f32_aligned_64x64_rf_sm80") == "fused"
    assert attention_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "fused"
    assert attention_kind(SOFTMAX) == "softmax"
    assert attention_kind(LOG_SOFTMAX) is None  # the loss's, not attention's
    assert attention_kind("sm90_xmma_gemm_bf16bf16_bf16f32") is None


def test_a_full_card_advises_checkpointing_before_anything_else():
    t = Builder().steps(5, 1000, transformer_step(SOFTMAX))
    f = figures(t, device="cuda", config={"precision": "bf16"}, has_blocks=True,
                mem_peak_gib=72.4, card_gib=79.6)
    v = judge_saved(f)
    assert v.rule == "memory-full" and "72.4 GiB of the card's 79.6 GiB (91%)" in v.reason
    assert [c.args for c in v.candidates] == [("--activation-checkpointing", "selective"),
                                              ("--activation-checkpointing", "full")]
    assert "slower at this batch" in v.lever.caveat
    assert any(s.startswith("attention-unfused") for s in v.secondary), v.secondary
    # Selective on already: full next; full on, or no blocks to wrap: FSDP or a smaller batch.
    on = judge_saved({**f, "config": {"activation_checkpointing": "selective"}})
    assert [c.args for c in on.candidates] == [("--activation-checkpointing", "full")]
    for other in ({**f, "has_blocks": False}, {**f, "config": {"activation_checkpointing":
                                                               "full"}}):
        v = judge_saved(other)
        assert v.rule == "memory-full" and v.candidates == [] and "FSDP2" in v.lever.text
    # Room left on the card, or no card size known: not this rule.
    assert judge_saved({**f, "mem_peak_gib": 40.0}).rule != "memory-full"
    assert judge_saved({k: v for k, v in f.items() if k != "card_gib"}).rule != "memory-full"


def test_unfused_attention_is_a_secondary_cause():
    t = Builder().steps(5, 1000, transformer_step(SOFTMAX))
    f = figures(t, device="cuda", config={"precision": "bf16"}, has_blocks=True)
    assert f["attention_ms"]["fused"] == 0 and f["attention_ms"]["softmax"] > 0
    v = judge_saved(f)
    assert v.rule == "device-bound (compute-bound)"
    assert "in convolutions and matrix products" in v.reason  # has_conv unknown: both named
    no_conv = judge_saved({**f, "has_conv": False}).reason
    assert "% of it in matrix products" in no_conv and "convolution" not in no_conv
    assert [s for s in v.secondary if s.startswith("attention-unfused")] == [
        "attention-unfused: attention runs unfused: softmax kernels take 22% of the device's "
        "time and no flash or memory-efficient attention kernel ran"]
    fused = figures(Builder().steps(5, 1000, transformer_step(FLASH)), device="cuda",
                    config={"precision": "bf16"}, has_blocks=True)
    assert fused["attention_ms"]["fused"] > 0
    assert not any(s.startswith("attention-unfused") for s in judge_saved(fused).secondary)
    # A model without blocks (a softmax classifier's head) is not judged on its attention.
    assert not any(s.startswith("attention-unfused")
                   for s in judge_saved({**f, "has_blocks": False}).secondary)


def test_unfused_attention_alone_advises_the_fused_kernel():
    t = Builder().steps(5, 1000, transformer_step(SOFTMAX, attention_us=700))
    f = figures(t, device="cuda", config={"sdpa_backend": "math"}, has_blocks=True)
    f["busy_pct"] = 50.0  # no device rule passes: the attention is the verdict
    v = judge_saved(f)
    assert v.rule == "attention-unfused" and v.lever.args == ("--sdpa-backend", "auto")
    v = judge_saved({**f, "config": {}})
    assert v.candidates == [] and "--attention sdpa" in v.lever.text


def test_a_small_transformer_is_host_bound():
    """gpt tiny on a GPU: short kernels, each launched as the device runs dry."""
    t = Builder().steps(5, 1000, gpu_step(n_kernels=19, kernel_us=20, launch_gap_us=50))
    v = judge_saved(figures(t, device="cuda", config={}, has_blocks=True, mem_peak_gib=0.1,
                      card_gib=79.6))
    assert v.rule == "host-bound" and v.lever.args == ("--cuda-graph",)
