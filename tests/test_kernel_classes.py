"""A real GPU step's trace, analysed: the kernels counted in the steps that launched them, and
grouped by kernel class (``kasoku.perf.profile.kernels.kernel_class``), the classes adding up to
the busy time. The fixture is GPT-2 small's top rung on one H200 (a CUDA graph per step)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kasoku.perf.profile import trace
from kasoku.perf.profile.kernels import kernel_class

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def test_work_queued_before_the_window_is_no_steps():
    # A real trace (GPT-2 small, the top rung: a CUDA graph replayed per step, one H200): the
    # host runs ahead of the GPU, so the window's first kernels are replays launched before
    # the profiler started, their launches not in the trace. They were counted into the
    # analysed steps by when they ran: 51.5 ms of kernels per 31.5 ms of busy device.
    r = trace.analyse(trace.load(FIXTURES / "h200-gpt-small-top.json.gz"))
    assert r["kernels_per_step"] == pytest.approx(488, abs=2)  # one replay's 486, and copies
    assert sum(r["by_kind_ms"].values()) == pytest.approx(r["device_ms"], rel=0.01)
    assert r["device_ms"] <= r["step_ms"]


@pytest.mark.parametrize("name, cls", [
    # kernel names from real H200 traces of GPT-2 small (kasoku's step and nanoGPT's)
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul/conv"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>",
     "matmul/conv"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64",
     "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "attention"),
    ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_6", "norm/element-wise"),
    ("triton_poi_fused__unsafe_view_gelu_gelu_backward_view_4", "norm/element-wise"),
    ("triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_eq_nll",
     "loss/softmax"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<8, c10::BFloat16, float>",
     "loss/softmax"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anon",
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>",
     "copies"),
    ("Memcpy HtoD (Pageable -> Device)", "copies"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "communication"),
    ("triton_tem_fused_mm_0", "matmul/conv"),
    # a gpu-jpeg-fed ResNet-50 step on an H200 (torchvision's nvJPEG decode, kasoku's crop):
    # the loader's, which the rule for convolutions took for one ("...Conversion")
    ("void nvjpeg::rgba2rgb<(nvjpegOutputFormat_t)3, nvjpeg::RGBAToRGBConversion::LaunchParams"
     "<32, 8> >(nvjpegImage_t, NppiSize, nvjpegImage_t)", "input"),
    ("crop_kernel", "input"),
])
def test_kernel_classes_by_name(name, cls):
    assert kernel_class(name) == cls


def test_the_classes_of_a_real_step_add_up_to_its_busy_time():
    r = trace.analyse(trace.load(FIXTURES / "h200-gpt-small-top.json.gz"))
    by_class = r["by_class_ms"]
    assert sum(by_class.values()) == pytest.approx(r["device_ms"], rel=0.01)  # overlaps
    assert max(by_class, key=by_class.get) == "matmul/conv"
    assert by_class["attention"] > 1 and by_class["loss/softmax"] > 1
    assert by_class["other"] == pytest.approx(0.0, abs=0.05)
