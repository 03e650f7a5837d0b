"""The stem's kernels: max pooling as Triton kernels (kasoku.accel.max_pool) and the stride-2
convolution folded space-to-depth (kasoku.accel.stem), against PyTorch's own ops."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.max_pool import max_pool2d
from kasoku.accel.stem import SpaceToDepthConv2d, foldable

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pool_both(x, kernel, stride, padding):
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = F.max_pool2d(a, kernel, stride, padding), max_pool2d(b, kernel, stride, padding)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    return want, got, a.grad, b.grad


@pytest.mark.parametrize("kernel,stride,padding,shape", [
    (3, 2, 1, (2, 70, 9, 11)),   # ResNet's stem pool; odd sides; a partial tile of channels
    (2, 2, 0, (1, 3, 6, 7)),
    (3, 1, 1, (1, 4, 5, 5)),     # overlapping windows: up to 9 per element
])
def test_max_pool_equals_pytorch_ties_included(interpreter, kernel, stride, padding, shape):
    g = torch.Generator().manual_seed(0)
    # After a ReLU most windows hold equal zeros: the gradient goes to the first of them.
    x = torch.relu(torch.randn(shape, generator=g)).contiguous(memory_format=torch.channels_last)
    want, got, grad_want, grad_got = pool_both(x, kernel, stride, padding)
    assert torch.equal(got, want) and torch.equal(grad_got, grad_want)
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_max_pool_refuses_padding_beyond_half_the_window():
    with pytest.raises(ValueError, match="padding"):
        max_pool2d(torch.zeros(1, 1, 4, 4), 3, 2, 2)


@pytest.mark.parametrize("kernel,padding,side", [(7, 3, 224), (7, 3, 33), (3, 1, 17), (4, 1, 12)])
def test_space_to_depth_convolution_is_the_same_convolution(kernel, padding, side):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, kernel, stride=2, padding=padding, bias=side == 33).double()
    x = torch.randn(2, 3, side, side + 1, dtype=torch.float64)
    y = conv(x)
    g = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, conv.weight, g)
    folded = SpaceToDepthConv2d.from_conv(conv)
    assert folded.weight is conv.weight
    assert list(folded.state_dict()) == list(conv.state_dict())
    y2 = folded(x)
    (got,) = torch.autograd.grad(y2, conv.weight, g)
    torch.testing.assert_close(y2, y, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_only_stride_two_convolutions_fold():
    assert foldable(nn.Conv2d(3, 8, 7, 2, 3))
    assert not foldable(nn.Conv2d(3, 8, 3, 1, 1))
    assert not foldable(nn.Conv2d(4, 8, 3, 2, 1, groups=2))
    with pytest.raises(ValueError, match="stride 2"):
        SpaceToDepthConv2d.from_conv(nn.Conv2d(3, 8, 3, 1, 1))


@cuda
def test_cuda_max_pool_of_the_resnet_stem():
    x = torch.relu(torch.randn(8, 64, 112, 112, device="cuda", dtype=torch.bfloat16))
    x = x.contiguous(memory_format=torch.channels_last)
    want, got, grad_want, grad_got = pool_both(x, 3, 2, 1)
    assert torch.equal(got, want) and torch.equal(grad_got, grad_want)


@cuda
def test_cuda_space_to_depth_stem_in_bfloat16():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 64, 7, 2, 3, bias=False).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    want = conv(x)
    folded = SpaceToDepthConv2d.from_conv(conv).to(memory_format=torch.channels_last)
    with torch.autocast("cuda", torch.bfloat16):
        got = folded(x.contiguous(memory_format=torch.channels_last))
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_apply_fast_stem_folds_the_stem_and_pools_with_the_kernels(interpreter):
    from kasoku.accel.max_pool import MaxPool2dKernel
    from kasoku.accel.notes import reset_warnings
    from kasoku.accel.stem import apply_fast_stem
    from kasoku.models.resnet import Bottleneck, ResNet

    def model():
        torch.manual_seed(0)
        return ResNet(Bottleneck, [1, 1, 1, 1], 10).to(memory_format=torch.channels_last)

    ref, fast = model(), model()
    notes = []
    assert apply_fast_stem(fast, "cpu", notes) is fast
    assert notes == []
    assert isinstance(fast.stem[0], SpaceToDepthConv2d) and isinstance(fast.stem[2],
                                                                      MaxPool2dKernel)
    # Only the stem: the stride-2 convolutions of the stages have more than 4 channels.
    assert sum(isinstance(m, SpaceToDepthConv2d) for m in fast.modules()) == 1
    assert list(fast.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([1, 7])
    losses = []
    for m in (ref, fast):
        loss = F.cross_entropy(m(x), t)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    torch.testing.assert_close(fast.stem[0].weight.grad, ref.stem[0].weight.grad,
                               atol=1e-5, rtol=1e-4)

    reset_warnings()
    notes = []
    apply_fast_stem(nn.Linear(2, 2), "cpu", notes)
    assert len(notes) == 1 and "nothing changed" in notes[0]


def test_apply_fast_stem_says_why_not_off_cuda(monkeypatch):
    from kasoku.accel.notes import reset_warnings
    from kasoku.accel.stem import apply_fast_stem
    from kasoku.models.resnet import resnet50

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reset_warnings()
    notes = []
    model = resnet50(10)
    apply_fast_stem(model, "cpu", notes)
    assert len(notes) == 1 and "CUDA" in notes[0]
    assert type(model.stem[0]) is nn.Conv2d
