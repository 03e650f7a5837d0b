"""kasoku's own models: shapes, parameter counts (torchvision's where it has the model),
LeNet5's seed-001 layer sizes, ResNet v1.5 stride placement and initialisation."""
import math

import pytest
import torch
from torch import nn

from kasoku.models import (
    MLP,
    BasicBlock,
    Bottleneck,
    LeNet5,
    ResNet,
    SineLSTM,
    resnet18,
    resnet50,
    resnet152,
)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mlp_shapes_and_size():
    model = MLP()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert model(torch.zeros(3, 784)).shape == (3, 10)
    # 784-1000-1000-10 with biases
    assert n_params(model) == 784 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 1000), (1000, 1000),
                                                                   (1000, 10)]
    assert len([m for m in MLP(depth=3).modules() if isinstance(m, nn.Linear)]) == 4
    with pytest.raises(ValueError, match="depth"):
        MLP(depth=0)


def test_mlp_lecun_normal_init():
    torch.manual_seed(0)
    layer = MLP().net[3]   # the 1000x1000 hidden layer: 1e6 draws
    assert abs(layer.weight.std().item() - 1 / math.sqrt(1000)) < 0.02 / math.sqrt(1000)
    assert torch.all(layer.bias == 0)


def test_lenet5_layer_sizes_as_seed_001():
    model = LeNet5()
    assert [(c.out_channels, c.kernel_size) for c in (model.conv1, model.conv2, model.conv3)] \
        == [(6, (5, 5)), (16, (5, 5)), (120, (4, 4))]
    assert (model.fc4.in_features, model.fc4.out_features) == (480, 84)   # 120 x 2 x 2
    assert (model.fc5.in_features, model.fc5.out_features) == (84, 10)
    shapes = {}
    for name in ("conv1", "conv2", "conv3"):
        getattr(model, name).register_forward_hook(
            lambda m, i, o, name=name: shapes.__setitem__(name, tuple(o.shape[1:])))
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert shapes == {"conv1": (6, 28, 28), "conv2": (16, 10, 10), "conv3": (120, 2, 2)}
    assert n_params(model) == 74_966


def test_lenet5_returns_logits_in_eval_too():
    torch.manual_seed(0)
    model = LeNet5()
    x = torch.randn(4, 3, 32, 32)
    train_out = model.train()(x)
    eval_out = model.eval()(x)
    torch.testing.assert_close(train_out, eval_out)   # no softmax switch at evaluation


def test_lenet5_other_sizes():
    assert LeNet5(in_channels=1, image_size=28).fc4.in_features == 120
    assert LeNet5(in_channels=1, image_size=28)(torch.zeros(1, 1, 28, 28)).shape == (1, 10)
    with pytest.raises(ValueError, match="28x28"):
        LeNet5(image_size=20)


def test_sine_lstm_shapes():
    model = SineLSTM()
    assert model(torch.zeros(3, 50, 1)).shape == (3, 50, 1)
    # Linear 1->5, LSTM 5->5 (4 gates, two bias vectors), Linear 5->1
    assert n_params(model) == (5 + 5) + 4 * 5 * (5 + 5 + 2) + (5 + 1)


@pytest.mark.parametrize("build, expected", [
    (lambda: resnet50(1000), 25_557_032),                          # torchvision resnet50
    (lambda: resnet152(1000, cifar_stem=False), 60_192_808),       # torchvision resnet152
    (lambda: ResNet(BasicBlock, [2, 2, 2, 2], 1000), 11_689_512),  # torchvision resnet18
    (lambda: resnet18(), 11_173_962),                              # CIFAR stem, 10 classes
    (lambda: resnet152(10, cifar_stem=True), 58_156_618),
], ids=["resnet50", "resnet152", "resnet18", "resnet18-cifar", "resnet152-cifar"])
def test_resnet_parameter_counts(build, expected):
    assert n_params(build()) == expected


def _stage_output_sizes(model: ResNet, x: torch.Tensor) -> list[int]:
    sizes = []
    for name in ("layer1", "layer2", "layer3", "layer4"):
        getattr(model, name).register_forward_hook(lambda m, i, o: sizes.append(o.shape[-1]))
    with torch.no_grad():
        model.eval()(x)
    return sizes


def test_resnet_stems():
    torch.manual_seed(0)
    imagenet = resnet50(10)
    assert any(isinstance(m, nn.MaxPool2d) for m in imagenet.stem)
    assert imagenet.stem[0].kernel_size == (7, 7) and imagenet.stem[0].stride == (2, 2)
    assert _stage_output_sizes(imagenet, torch.randn(1, 3, 64, 64)) == [16, 8, 4, 2]
    cifar = resnet50(10, cifar_stem=True)
    assert not any(isinstance(m, nn.MaxPool2d) for m in cifar.stem)
    assert cifar.stem[0].kernel_size == (3, 3) and cifar.stem[0].stride == (1, 1)
    assert _stage_output_sizes(cifar, torch.randn(1, 3, 32, 32)) == [32, 16, 8, 4]


def test_resnet50_is_v1_5():
    model = resnet50()
    for stage, stride in (("layer1", 1), ("layer2", 2), ("layer3", 2), ("layer4", 2)):
        first = getattr(model, stage)[0]
        assert isinstance(first, Bottleneck)
        assert first.conv1.stride == (1, 1)            # v1 would put the stride here
        assert first.conv2.stride == (stride, stride)  # v1.5: on the 3x3
        assert first.conv3.stride == (1, 1)
        assert first.downsample[0].stride == (stride, stride)
        for block in getattr(model, stage)[1:]:
            assert block.downsample is None and block.conv2.stride == (1, 1)


def test_resnet_init():
    torch.manual_seed(0)
    model = resnet50()
    conv = model.layer3[0].conv2   # 256 -> 256, 3x3: fan_out = 256 * 9
    assert abs(conv.weight.std().item() - math.sqrt(2 / (256 * 9))) < 0.03 * math.sqrt(2 / 2304)
    for block in model.modules():
        if isinstance(block, Bottleneck):
            assert torch.all(block.bn3.weight == 0)
            assert torch.all(block.bn1.weight == 1) and torch.all(block.bn1.bias == 0)
    plain = resnet50(zero_init_residual=False)
    assert all(torch.all(b.bn3.weight == 1) for b in plain.modules() if isinstance(b, Bottleneck))
    basic = ResNet(BasicBlock, [1, 1, 1, 1], 10)
    assert all(torch.all(b.bn2.weight == 0) for b in basic.modules() if isinstance(b, BasicBlock))


def test_zero_init_residual_block_starts_as_identity():
    torch.manual_seed(0)
    block = resnet50().layer1[1]   # no downsample: the skip is the identity
    x = torch.randn(2, 256, 8, 8)
    torch.testing.assert_close(block(x), torch.relu(x))


def test_resnet_forward_shapes():
    torch.manual_seed(0)
    assert resnet50(1000)(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    with torch.no_grad():
        assert resnet152()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
