"""``kasoku.perf.profile.kernels``: the kernel-time split by kind, on real kernel names (from a
ResNet-50 step on an H200) and on a real profiled training step on this CPU."""
import pytest
import torch
from torch import nn

from kasoku.perf.profile.kernels import (
    CATEGORIES,
    OPTIMIZER_PREFIX,
    breakdown,
    classify,
    format_breakdown,
    profile_steps,
)

H200_KERNELS = {  # names as torch.profiler reported them (torch 2.11, cuDNN 9)
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_"
    "warpgroupsize1x1x1_g1_execute_segment_k_off_kernel__5x_cudnn": "conv/matmul",
    "sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_"
    "warpgroupsize1x1x1_g1": "conv/matmul",
    "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_256x64_"
    "32x4_nhwc_align8>(cutlass_tensorop_bf16_s16816fprop_optimized_bf16_256x64_32x4_nhwc_"
    "align8::Params)": "conv/matmul",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "conv/matmul",
    "triton_poi_fused_add_max_pool2d_with_indices_max_pool2d_with_indices_backward_63": "triton",
    "triton_red_fused__native_batch_norm_legit_functional_8": "triton",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<3>, at::native::(anonymous namespace)::FusedSgdMathFunctor"
    "<float, 3>, double, double, double, bool, bool, bool, float const*, float const*>":
        "optimizer",
    "Memcpy DtoD (Device -> Device)": "copy/fill",
    "Memset (Device)": "copy/fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)":
        "other",
    # a gpu-jpeg loader's colour conversion: no convolution
    "void nvjpeg::rgba2rgb<(nvjpegOutputFormat_t)3, nvjpeg::RGBAToRGBConversion::LaunchParams"
    "<32, 8> >(nvjpegImage_t, NppiSize, nvjpegImage_t)": "other",
}


@pytest.mark.parametrize("name, category", H200_KERNELS.items())
def test_real_kernel_names_are_classified(name, category):
    assert classify(name) == category


def test_cpu_operator_names():
    assert classify("aten::mkldnn_convolution") == "conv/matmul"
    assert classify("aten::addmm") == "conv/matmul"
    assert classify("aten::copy_") == "copy/fill"
    assert classify("aten::relu") == "other"
    assert classify(OPTIMIZER_PREFIX + "aten::mul_") == "optimizer"


def test_breakdown_sums_per_kind_and_per_step():
    names = list(H200_KERNELS)
    timings = [(names[0], 2e-3), (names[0], 1e-3), (names[4], 1.5e-3), (names[6], 0.5e-3),
               (names[7], 0.25e-3), (names[9], 0.25e-3)]
    b = breakdown(timings, steps=2, wall_s=8e-3, device="cuda")
    assert b.by_category_s == pytest.approx({"conv/matmul": 3e-3, "triton": 1.5e-3,
                                             "optimizer": 0.5e-3, "copy/fill": 0.25e-3,
                                             "other": 0.25e-3})
    assert b.kernel_s == pytest.approx(5.5e-3)
    assert b.kernels[0] == (names[0], pytest.approx(3e-3), 2)
    d = b.to_dict()
    assert d["wall_ms_per_step"] == pytest.approx(4.0)
    assert d["kernel_ms_per_step"] == pytest.approx(2.75)
    assert d["launches_per_step"] == 3
    assert d["by_category_ms_per_step"]["conv/matmul"] == pytest.approx(1.5)
    text = format_breakdown(b)
    assert "2.75 ms/step kernel time" in text and "conv/matmul" in text
    with pytest.raises(ValueError):
        breakdown(timings, steps=0, wall_s=1.0, device="cuda")


def test_a_profiled_cpu_training_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))

    def steps():
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    steps()  # warm
    b = profile_steps(steps, "cpu", steps=3)
    assert set(b.by_category_s) == set(CATEGORIES)
    assert b.by_category_s["conv/matmul"] > 0 and b.by_category_s["optimizer"] > 0
    assert 0 < b.kernel_s <= b.wall_s
    # Adam without foreach: per weight (4 tensors) at least mul_, add_, addcdiv_ per step
    optimizer_launches = sum(n for name, _, n in b.kernels if classify(name) == "optimizer")
    assert optimizer_launches >= 3 * 4 * 3
