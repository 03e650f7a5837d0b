"""FLOPs counted per training step, MFU arithmetic and the matmul peak probe (CPU, fast)."""
import pytest
import torch
from torch import nn

from kasoku.perf import flops as flops_mod
from kasoku.perf.flops import count_step_flops
from kasoku.perf.mfu import compute_mfu
from kasoku.perf.peak import measure_bandwidth, measure_matmul_peak

SIZES = [(20, 30), (30, 40), (40, 5)]


def mlp():
    torch.manual_seed(0)
    layers = []
    for i, (n_in, n_out) in enumerate(SIZES):
        layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(SIZES) - 1 else [])
    return nn.Sequential(*layers)


def batch(bs, device):
    return (torch.randn(bs, 20, device=device), torch.randint(0, 5, (bs,), device=device))


def test_mlp_flops_equal_the_hand_formula():
    bs = 8
    count = count_step_flops(mlp(), batch, nn.functional.cross_entropy, bs)
    # Forward: 2*B*in*out per layer. Backward: the weight gradient (2*B*in*out) for every
    # layer, the input gradient (2*B*in*out) for all but the first (the data needs none).
    forward = sum(2 * bs * i * o for i, o in SIZES)
    backward = sum(2 * bs * i * o for i, o in SIZES) + sum(2 * bs * i * o for i, o in SIZES[1:])
    assert (count.forward, count.backward, count.total) == (forward, backward,
                                                            forward + backward)
    assert count.method == "meta" and count.batch_size == bs
    assert count.per_sample == (forward + backward) / bs
    assert sum(count.by_op.values()) == count.total
    assert set(count.by_op) == {"aten.addmm", "aten.mm"}


def test_conv_flops_and_the_model_is_left_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 5))
    before = [p.detach().clone() for p in model.parameters()]
    bs = 3
    count = count_step_flops(model, lambda b, d: (torch.randn(b, 3, 6, 6, device=d),
                                                  torch.randint(0, 5, (b,), device=d)),
                             nn.functional.cross_entropy, bs)
    conv = 2 * bs * 4 * 6 * 6 * 3 * 3 * 3  # 2 * B * C_out * H * W * C_in * k * k
    linear = 2 * bs * 144 * 5
    assert count.forward == conv + linear
    assert count.backward == conv + 2 * linear  # no input gradient for the first conv
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).device.type == "cpu"


def test_fallback_without_meta_counts_a_small_batch_and_scales(monkeypatch):
    exact = count_step_flops(mlp(), batch, nn.functional.cross_entropy, 8)

    def no_meta(model):
        raise NotImplementedError("no meta kernel")

    monkeypatch.setattr(flops_mod, "meta_copy", no_meta)
    scaled = count_step_flops(mlp(), batch, nn.functional.cross_entropy, 8)
    assert scaled.method == "cpu-batch-2-scaled"
    assert (scaled.forward, scaled.backward) == (exact.forward, exact.backward)


def test_resnet50_forward_matches_the_published_4_1_gmacs():
    from kasoku.models import resnet50
    count = count_step_flops(resnet50(num_classes=1000),
                             lambda b, d: (torch.randn(b, 3, 224, 224, device=d),
                                           torch.randint(0, 1000, (b,), device=d)),
                             nn.functional.cross_entropy, 4)
    assert 8.0e9 < count.forward / 4 < 8.4e9  # 2 FLOPs per multiply-add
    assert 2.9 < count.total / count.forward < 3.0  # backward ~2x, less the stem's input grad


def test_mfu_arithmetic_and_when_it_is_withheld():
    value, note = compute_mfu(1e12, 0.01, 200e12, "bf16")
    assert value == pytest.approx(0.5) and "bf16" in note
    for args in [(0, 0.01, 1e12, "fp32"), (None, 0.01, 1e12, "fp32"),
                 (1e12, None, 1e12, "fp32"), (1e12, 0.01, None, "tf32")]:
        value, note = compute_mfu(*args)
        assert value is None and note.startswith("N/A")
    value, note = compute_mfu(1e12, 0.001, 1e12, "fp32")  # 100% of the peak is impossible
    assert value is None and "mislead" in note


def test_peak_probe_on_cpu_is_positive_and_quick():
    r = measure_matmul_peak("cpu", "fp32", size=64, reps=3)
    assert r.flops_per_s > 0 and r.min_flops_per_s <= r.flops_per_s <= r.max_flops_per_s
    assert (r.size, r.device, r.dtype) == (64, "cpu", "fp32")
    assert 3 <= r.reps <= 9 and (r.stable or r.reps == 9)  # more runs where they disagree
    assert r.products_per_rep >= 1 and r.threads == torch.get_num_threads()
    assert measure_matmul_peak("cpu", "bf16", size=64, reps=3).flops_per_s > 0
    with pytest.raises(ValueError, match="tf32"):
        measure_matmul_peak("cpu", "tf32", size=64)
    with pytest.raises(ValueError, match="unknown peak dtype"):
        measure_matmul_peak("cpu", "fp8", size=64)


def test_bandwidth_probe_on_cpu_counts_a_copy_read_and_written():
    size = 64 << 20  # 64 MiB: past this machine's caches, a tenth of a second to copy
    r = measure_bandwidth("cpu", size_bytes=size, reps=3)
    assert r.size_bytes == size and r.device == "cpu" and r.copies_per_rep >= 1
    assert r.min_bytes_per_s <= r.bytes_per_s <= r.max_bytes_per_s
    # a DDR channel moves 1-100 GB/s; a copy of 2 x 64 MiB in under a second either way
    assert 1e9 < r.bytes_per_s < 1e12
    with pytest.raises(ValueError, match="size_bytes"):
        measure_bandwidth("cpu", size_bytes=0)
