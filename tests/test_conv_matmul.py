"""1x1 convolutions as matrix products (kasoku.accel.conv_matmul) against nn.Conv2d itself."""
import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.compose import accelerate, check_config
from kasoku.accel.config import AccelConfig
from kasoku.accel.conv_matmul import Conv1x1Matmul, apply_matmul_1x1, matmul_able
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.core.errors import ConfigError
from kasoku.models.resnet import Bottleneck, ResNet
from kasoku.optim import make_optimizer

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


def grads(conv, x, g):
    x = x.clone().requires_grad_()
    y = conv(x)
    gx, gw, *gb = torch.autograd.grad(y, [x, conv.weight] + ([conv.bias] if conv.bias is not None
                                                             else []), g)
    return y, gx, gw, gb


@pytest.mark.parametrize("stride,bias,side", [(1, False, 7), (2, False, 7), (2, True, 8),
                                              (1, True, 5)])
def test_matrix_product_is_the_same_convolution(stride, bias, side):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 10, 1, stride=stride, bias=bias).double() \
        .to(memory_format=torch.channels_last)
    x = torch.randn(3, 6, side, side + 1, dtype=torch.float64) \
        .contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(conv(x))
    want = grads(conv, x, g)
    mm = Conv1x1Matmul.from_conv(conv)
    assert mm.weight is conv.weight and list(mm.state_dict()) == list(conv.state_dict())
    got = grads(mm, x, g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1:3] + tuple(got[3]), want[1:3] + tuple(want[3])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # The output and the input's gradient stay channels_last: what the next layer expects.
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert got[1].is_contiguous(memory_format=torch.channels_last)


def test_nchw_inputs_take_the_convolution_and_other_kernels_are_refused():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 5, 1)
    x = torch.randn(2, 4, 3, 3)  # NCHW: no matrix in memory to multiply
    torch.testing.assert_close(Conv1x1Matmul.from_conv(conv)(x), conv(x), rtol=0, atol=0)
    assert not matmul_able(nn.Conv2d(4, 5, 3))
    assert not matmul_able(nn.Conv2d(4, 5, 1, padding=1))
    assert not matmul_able(nn.Conv2d(4, 4, 1, groups=2))
    assert not matmul_able(nn.Conv2d(4, 5, 1, stride=(1, 2)))
    with pytest.raises(ValueError, match="1x1 kernel"):
        Conv1x1Matmul.from_conv(nn.Conv2d(4, 5, 3))


def small_resnet():
    torch.manual_seed(0)
    return ResNet(Bottleneck, [1, 1, 1, 1], 10).to(memory_format=torch.channels_last)


def test_apply_converts_every_1x1_convolution_of_a_resnet_and_trains_the_same():
    ref, fast = small_resnet(), small_resnet()
    ones = [m for m in ref.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)]
    notes = []
    assert apply_matmul_1x1(fast, notes) is fast
    assert notes == []
    # 2 per bottleneck and the 4 downsample projections (one of stride 1, three of stride 2).
    assert sum(type(m) is Conv1x1Matmul for m in fast.modules()) == len(ones) == 12
    assert list(fast.state_dict()) == list(ref.state_dict())
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([1, 7, 3, 0])
    losses = []
    for m in (ref, fast):
        loss = F.cross_entropy(m(x), t)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for a, b in zip(ref.parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)


def test_a_model_without_1x1_convolutions_is_noted_and_nchw_is_refused():
    notes = []
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.warns(UserWarning, match="no 1x1 convolution"):
        apply_matmul_1x1(model, notes)
    assert len(notes) == 1 and type(model[0]) is nn.Conv2d
    with pytest.raises(ConfigError, match="--channels-last"):
        check_config(AccelConfig(matmul_1x1=True))


def test_composed_with_channels_last_and_bf16_on_cpu_it_trains():
    cfg = AccelConfig(precision="bf16", channels_last=True, matmul_1x1=True,
                      optimizer_impl="fused")
    acc = accelerate(small_resnet(), F.cross_entropy, None, cfg, "cpu",
                     lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl))
    assert acc.notes == [] and sum(type(m) is Conv1x1Matmul for m in acc.model.modules()) == 12
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    losses = [float(acc.step_fn(acc.model, (x, y), acc.optimizer)["main/loss"])
              for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0]


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_accel_arguments(parser)
    cfg = accel_config_from_args(parser.parse_args(["--channels-last", "--matmul-1x1"]))
    assert cfg == AccelConfig(channels_last=True, matmul_1x1=True)
    assert "matrix products" in parser.format_help()
