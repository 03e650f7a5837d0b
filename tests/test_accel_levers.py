import argparse
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.compile import apply_compile, has_cxx_compiler
from kasoku.accel.compose import Accelerated, accelerate
from kasoku.accel.config import AccelConfig
from kasoku.accel.cudnn import apply_cudnn_benchmark
from kasoku.accel.graph import apply_cuda_graph, prepare_optimizer_for_graph
from kasoku.accel.lr_rules import goyal_warmup_epochs, linear_scaling_lr
from kasoku.accel.memory_format import ChannelsLastInputs, apply_channels_last
from kasoku.accel.notes import LeverWarning
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.core.errors import ConfigError
from kasoku.models.mlp import MLP
from kasoku.optim import make_optimizer
from kasoku.train.step import Objective, StandardStep

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


class ConvNet(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 4)
        self.seen_channels_last = None
        self.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        self.seen_channels_last = args[0].is_contiguous(memory_format=torch.channels_last)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


def accuracy(output, target):
    return (output.argmax(1) == target).float().mean()


def images(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return x, torch.randint(0, 4, (n,), generator=g)


def momentum_sgd(lr=0.05):
    return lambda params, impl: make_optimizer("momentum", params, lr, impl=impl)


def test_channels_last_converts_a_conv_net_and_its_inputs():
    model = apply_channels_last(ConvNet())
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    opt = make_optimizer("momentum", model.parameters(), 0.05)
    step = ChannelsLastInputs(StandardStep(F.cross_entropy, accuracy))
    step(model, images(), opt)
    assert model.seen_channels_last


def test_channels_last_warns_once_for_a_model_without_convolutions():
    notes = []
    with pytest.warns(LeverWarning, match="MLP has no 2-d convolution"):
        model = apply_channels_last(MLP(8, 16, 3), notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_channels_last(MLP(8, 16, 3), notes)
    assert len(notes) == 2 and isinstance(model, MLP)


def test_cudnn_benchmark_says_once_it_has_no_effect_on_cpu():
    notes = []
    with pytest.warns(LeverWarning, match="no effect on cpu"):
        assert apply_cudnn_benchmark(True, "cpu", notes) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_cudnn_benchmark(True, "cpu", notes)
        apply_cudnn_benchmark(False, "cpu", notes)  # not asked for: no note
    assert len(notes) == 2


def test_compile_is_in_place_and_keeps_state_dict_keys():
    model = MLP(8, 16, 3, depth=1)
    keys = list(model.state_dict())
    compiled = apply_compile(model, "cpu", backend="aot_eager")
    assert compiled is model and list(model.state_dict()) == keys
    with pytest.raises(ConfigError, match="compile mode"):
        apply_compile(model, "cpu", mode="fast")


def test_combo_kernels_reach_inductor_and_are_refused_elsewhere(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: seen.update(kw))
    apply_compile(MLP(8, 16, 3), "cpu", combo_kernels=True)
    assert seen["options"] == {"combo_kernels": True} and seen["mode"] is None
    with pytest.raises(ConfigError, match="compile mode default"):
        apply_compile(MLP(8, 16, 3), "cpu", combo_kernels=True, mode="max-autotune")
    from kasoku.accel.compose import check_config
    with pytest.raises(ConfigError, match="add --compile"):
        check_config(AccelConfig(combo_kernels=True))


@pytest.mark.skipif(not has_cxx_compiler(), reason="inductor on a CPU needs a C++ compiler")
def test_combo_kernels_compile_the_same_function():
    torch.manual_seed(0)
    model, ref = MLP(8, 16, 3, depth=2), MLP(8, 16, 3, depth=2)
    ref.load_state_dict(model.state_dict())
    apply_compile(model, "cpu", combo_kernels=True)
    x = torch.randn(5, 8)
    y, want = model(x), ref(x)
    y.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(y, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _train_mlp(cfg, steps=4):
    """The accelerated run and each step's (loss, accuracy)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    acc = accelerate(MLP(8, 16, 3, depth=1), F.cross_entropy, accuracy, cfg, "cpu",
                     momentum_sgd())
    seen = [acc.step_fn(acc.model, (x, y), acc.optimizer) for _ in range(steps)]
    return acc, [(float(s["main/loss"]), float(s["main/accuracy"])) for s in seen]


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one():
    # inductor on the CPU: ~6-13 s the first time (C++ compilation), cached afterwards.
    _, eager = _train_mlp(AccelConfig())
    acc, compiled = _train_mlp(AccelConfig(compile=True, optimizer_impl="fused"))
    # the loss and the accuracy are compiled too, as one graph (the step's Objective)
    objective = acc.step_fn.objective
    assert not isinstance(objective, Objective)  # torch.compile's wrapper of one
    assert isinstance(inspect.unwrap(objective), Objective)
    assert [loss for loss, _ in compiled] == pytest.approx([loss for loss, _ in eager],
                                                           rel=1e-4, abs=1e-5)
    assert [a for _, a in compiled] == [a for _, a in eager]


def test_composed_config_on_cpu_skips_what_cannot_apply_and_trains():
    cfg = AccelConfig(precision="bf16", channels_last=True, cudnn_benchmark=True,
                      optimizer_impl="fused", cuda_graph=True)
    with pytest.warns(LeverWarning):
        acc = accelerate(ConvNet(), F.cross_entropy, accuracy, cfg, "cpu", momentum_sgd())
    assert isinstance(acc, Accelerated) and isinstance(acc.step_fn, ChannelsLastInputs)
    assert acc.optimizer.defaults["fused"] and acc.extensions == []
    assert [n.split(":")[0] for n in acc.notes] == ["cudnn_benchmark", "cuda_graph"]
    x, y = images(32)
    losses = [float(acc.step_fn(acc.model, (x, y), acc.optimizer)["main/loss"])
              for _ in range(10)]
    assert losses[-1] < 0.8 * losses[0] and acc.model.seen_channels_last


def test_fp16_pure_on_cpu_becomes_fp32_with_a_note():
    with pytest.warns(LeverWarning, match="float16 training needs a CUDA device"):
        acc = accelerate(ConvNet(), F.cross_entropy, accuracy,
                         AccelConfig(precision="fp16-pure", optimizer_impl="loop"), "cpu",
                         momentum_sgd())
    assert acc.model.conv.weight.dtype == torch.float32 and len(acc.notes) == 1
    assert isinstance(acc.step_fn, StandardStep)


@pytest.mark.parametrize("cfg,match", [
    (AccelConfig(cuda_graph=True, compile=True, compile_mode="reduce-overhead"), "two layers"),
    (AccelConfig(cuda_graph=True, compile=True, compile_mode="max-autotune"), "two layers"),
    (AccelConfig(precision="fp8"), "unknown precision"),
    (AccelConfig(optimizer_impl="vectorized"), "implementation"),
    (AccelConfig(compile=True, compile_mode="fastest"), "compile mode"),
    (AccelConfig(precision="fp16", loss_scale_init=0.0), "loss_scale_init"),
])
def test_invalid_combinations_are_refused(cfg, match):
    with pytest.raises(ConfigError, match=match):
        accelerate(ConvNet(), F.cross_entropy, accuracy, cfg, "cpu", momentum_sgd())


def test_cuda_graph_is_skipped_on_cpu():
    step = StandardStep(F.cross_entropy)
    notes = []
    with pytest.warns(LeverWarning, match="CUDA graphs need a CUDA device"):
        assert apply_cuda_graph(step, "cpu", None, notes) is step
    assert len(notes) == 1


def test_graph_preparation_makes_lrs_device_tensors_and_refuses_host_bound_sgd():
    model = ConvNet()
    fused = make_optimizer("momentum", model.parameters(), 0.05, impl="fused")
    prepare_optimizer_for_graph(fused, "cpu")
    lr = fused.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32
    assert float(lr) == pytest.approx(0.05)
    prepare_optimizer_for_graph(fused, "cpu")
    assert fused.param_groups[0]["lr"] is lr  # already prepared: kept
    adam = make_optimizer("adam", model.parameters(), 1e-3, impl="foreach")
    prepare_optimizer_for_graph(adam, "cpu")
    assert adam.param_groups[0]["capturable"]
    prepare_optimizer_for_graph(make_optimizer("lars", model.parameters(), 0.1), "cpu")
    with pytest.raises(ConfigError, match="--optimizer-impl fused"):
        prepare_optimizer_for_graph(make_optimizer("momentum", model.parameters(), 0.1,
                                                   impl="foreach"), "cpu")


def test_schedules_write_a_tensor_lr_in_place_and_log_each_value(tmp_path):
    from kasoku.data.base import ArrayDataset
    from kasoku.data.loader import SerialLoader
    from kasoku.train import Trainer
    from kasoku.train.extensions import LinearWarmup, LogReport

    model = ConvNet()
    opt = make_optimizer("momentum", model.parameters(), 0.4, impl="fused")
    prepare_optimizer_for_graph(opt, "cpu")
    lr = opt.param_groups[0]["lr"]
    x, y = images(64)
    trainer = Trainer(model, opt, SerialLoader(ArrayDataset(x, y), 16, seed=0), F.cross_entropy,
                      stop_trigger=(4, "iteration"), out=tmp_path)
    trainer.extend(LinearWarmup(1.0))  # 4 iterations per epoch: 0.1, 0.2, 0.3, 0.4
    trainer.extend(LogReport(trigger=(1, "iteration")))
    trainer.run()
    assert opt.param_groups[0]["lr"] is lr
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(0.4)
    logged = [e["lr"] for e in trainer.get_extension("LogReport").log]
    assert logged == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_cli_arguments_build_an_accel_config():
    parser = argparse.ArgumentParser()
    add_accel_arguments(parser)
    assert accel_config_from_args(parser.parse_args([])) == AccelConfig()
    cfg = accel_config_from_args(parser.parse_args(
        ["--precision", "bf16", "--channels-last", "--cudnn-benchmark", "--optimizer-impl",
         "fused", "--compile", "--cuda-graph"]))
    assert cfg == AccelConfig(precision="bf16", channels_last=True, cudnn_benchmark=True,
                              optimizer_impl="fused", compile=True, compile_mode="default",
                              cuda_graph=True)
    cfg = accel_config_from_args(parser.parse_args(["--compile", "max-autotune-no-cudagraphs"]))
    assert cfg.compile and cfg.compile_mode == "max-autotune-no-cudagraphs"
    assert "NHWC memory format" in parser.format_help()
    for wrong in (["--precision", "fp8"], ["--loss-scale-init", "inf"],
                  ["--steps-per-call", "0"], ["--compile", "fastest"]):
        with pytest.raises(SystemExit):
            parser.parse_args(wrong)


def test_linear_scaling_rule_and_goyal_warmup():
    assert linear_scaling_lr(0.1, 8192) == pytest.approx(3.2)
    assert linear_scaling_lr(0.1, 256) == pytest.approx(0.1)
    assert goyal_warmup_epochs(8192) == 5.0
    assert goyal_warmup_epochs(256) == 0.0
    with pytest.raises(ConfigError):
        linear_scaling_lr(0.1, 0)
