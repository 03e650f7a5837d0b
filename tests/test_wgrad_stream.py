"""Weight gradients on a second stream (kasoku.accel.wgrad_stream): the same numbers as
nn.Conv2d, the gradient handed to autograd without a copy, one join per backward pass, and on
CUDA the side stream's results against the one-stream computation."""
import argparse
import contextlib
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel import wgrad_stream
from kasoku.accel.compile import apply_compile
from kasoku.accel.compose import accelerate, check_config
from kasoku.accel.config import AccelConfig
from kasoku.accel.conv_matmul import Conv1x1Matmul, apply_matmul_1x1
from kasoku.accel.wgrad_stream import WgradStreamConv2d, apply_wgrad_stream, convert
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.core.errors import ConfigError
from kasoku.models.resnet import Bottleneck, ResNet
from kasoku.optim import make_optimizer

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


def grads(conv, x, g):
    x = x.clone().requires_grad_()
    y = conv(x)
    params = [conv.weight] + ([conv.bias] if conv.bias is not None else [])
    return (y, *torch.autograd.grad(y, [x] + params, g))


@pytest.mark.parametrize("kw", [dict(kernel_size=3, padding=1),
                                dict(kernel_size=3, stride=2, padding=1, bias=True),
                                dict(kernel_size=(3, 2), padding=(2, 0), dilation=(2, 1)),
                                dict(kernel_size=3, groups=2, padding=1),
                                dict(kernel_size=5, stride=2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_weight_gradient_is_nn_conv2ds(kw, channels_last):
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv = nn.Conv2d(4, 6, bias=kw.pop("bias", False), **kw).double().to(memory_format=fmt)
    x = torch.randn(3, 4, 11, 9, dtype=torch.float64).contiguous(memory_format=fmt)
    g = torch.randn_like(conv(x))
    want = grads(conv, x, g)
    fast = WgradStreamConv2d.from_conv(conv)
    assert fast.weight is conv.weight and list(fast.state_dict()) == list(conv.state_dict())
    got = grads(fast, x, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got[2].stride() == conv.weight.stride()


@pytest.mark.parametrize("stride,bias", [(1, False), (2, True)])
def test_matmul_weight_gradient_is_nn_conv2ds(stride, bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 10, 1, stride=stride, bias=bias).double() \
        .to(memory_format=torch.channels_last)
    x = torch.randn(3, 6, 7, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(conv(x))
    want = grads(conv, x, g)
    mm = Conv1x1Matmul.from_conv(conv)
    assert convert(mm) == 0 and mm.wgrad_stream is False  # converts children, not the root
    mm.wgrad_stream = True
    for inputs in (x, x.contiguous()):  # the matrix product, and the NCHW fallback
        got = grads(mm, inputs, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def small_resnet():
    torch.manual_seed(0)
    return ResNet(Bottleneck, [1, 1, 1, 1], 10).to(memory_format=torch.channels_last)


def test_gradients_are_handed_over_uncopied_and_joined_once_per_backward(monkeypatch):
    # autograd must take each weight gradient as .grad itself: a copy would be a main-stream
    # kernel reading it before the join. (Addresses only: holding the tensors here would
    # itself stop autograd from taking them.)
    made, joins = [], []
    real = wgrad_stream._deferred

    def deferred(product, reads):
        out = real(product, reads)
        made.append(out.data_ptr())
        return out
    monkeypatch.setattr(wgrad_stream, "_deferred", deferred)
    monkeypatch.setattr(wgrad_stream, "join_all", lambda: joins.append(1))
    model = small_resnet()
    apply_matmul_1x1(model)
    assert convert(model) == 17  # 12 as matrix products, four 3x3 and the 7x7 stem
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        made.clear()
        F.cross_entropy(model(x), torch.tensor([1, 2])).backward()
        assert len(joins) == step + 1
        convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert len(made) == len(convs) == 17
        assert {w.grad.data_ptr() for w in convs} == set(made)
    # Outside a backward pass (nothing would join later) the op joins at once.
    w = torch.randn(4, 3, 1, 1)
    wgrad_stream.wgrad_mm(torch.randn(5, 4), torch.randn(5, 3), w)
    assert len(joins) == 3


def test_bf16_autocast_and_compiled_it_trains_like_the_plain_model():
    cfg = AccelConfig(precision="bf16", channels_last=True, matmul_1x1=True,
                      optimizer_impl="fused")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    losses = {}
    for deferred in (False, True):
        acc = accelerate(small_resnet(), F.cross_entropy, None, cfg, "cpu",
                         lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl))
        if deferred:
            assert convert(acc.model) == 17
            acc.model.compile(backend="aot_eager")  # the ops traced, fake shapes and strides
        losses[deferred] = [float(acc.step_fn(acc.model, (x, y), acc.optimizer)["main/loss"])
                            for _ in range(6)]
    assert losses[True][-1] < 0.6 * losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


def test_skipped_off_cuda_and_refused_with_inductors_graphs(monkeypatch):
    notes = []
    model = small_resnet()
    with pytest.warns(UserWarning, match="second CUDA stream"):
        assert apply_wgrad_stream(model, "cpu", notes) is model
    assert len(notes) == 1 and not any(type(m) is WgradStreamConv2d for m in model.modules())
    with pytest.raises(ConfigError, match="max-autotune-no-cudagraphs"):
        check_config(AccelConfig(wgrad_stream=True, compile=True, compile_mode="reduce-overhead"))
    assert not wgrad_stream.deferrable(nn.Conv2d(3, 4, 3, padding="same"))
    assert not wgrad_stream.deferrable(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="zero padding"):
        WgradStreamConv2d.from_conv(nn.Conv2d(3, 4, 3, padding="same"))
    # inductor's buffer reuse goes off, beside a mode's own options.
    seen = {}
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.update(kw))
    apply_compile(nn.Linear(2, 2), mode="max-autotune-no-cudagraphs", buffer_reuse=False)
    assert seen["mode"] is None and seen["options"]["allow_buffer_reuse"] is False
    assert seen["options"]["max_autotune"] is True
    apply_compile(nn.Linear(2, 2))
    assert seen["mode"] is None and seen["options"] is None


def test_graphed_or_second_stream_steps_compile_for_static_shapes(monkeypatch):
    # After a build at another batch size in the process, torch.compile compiles again for a
    # symbolic batch size, and those builds of the graphed DDP step with and without the
    # second stream disagreed (the GPU test below); the model and the objective of those
    # steps are compiled for their own shapes only, other steps' as they were.
    from kasoku.accel import compile as compile_module
    seen = []
    monkeypatch.setattr(compile_module, "has_cxx_compiler", lambda: True)
    monkeypatch.setattr(nn.Module, "compile",
                        lambda self, **kw: seen.append(("model", kw["dynamic"])))

    def objective(fn, **kw):
        seen.append(("objective", kw["dynamic"]))
        return fn
    monkeypatch.setattr(torch, "compile", objective)
    for cfg in (AccelConfig(compile=True, wgrad_stream=True),
                AccelConfig(compile=True, cuda_graph=True), AccelConfig(compile=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no second stream nor graph on the CPU
            accelerate(small_resnet(), F.cross_entropy, None, cfg, torch.device("cpu"),
                       lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl))
    assert seen == [(part, dynamic) for dynamic in (False, False, None)
                    for part in ("model", "objective")]


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_accel_arguments(parser)
    cfg = accel_config_from_args(parser.parse_args(["--wgrad-stream"]))
    assert cfg == AccelConfig(wgrad_stream=True)
    assert "second CUDA stream" in " ".join(parser.format_help().split())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled,graph", [(False, False), (True, False), (True, True)])
def test_cuda_side_stream_gradients_match_one_stream(compiled, graph):
    # The step (eager, compiled by inductor, or compiled and graph-captured) with and without
    # the lever, from the same weights: one step on the same batch must give the same
    # gradients. A stream race (a buffer reused before the side stream read it) would not.
    cfg = AccelConfig(precision="bf16", channels_last=True, matmul_1x1=True, compile=compiled,
                      optimizer_impl="fused", cuda_graph=graph)
    assert_same_gradients(cfg, torch.device("cuda"), batch=64, steps=14)


def assert_same_gradients(cfg: AccelConfig, dev, batch: int, steps: int, distribute=None):
    """The step of ``cfg`` with and without the lever, from the same weights, after ``steps``
    steps (warm-up, compilation, capture, replays): one more step on the same batch must give
    the same gradients. ``distribute``: makes each build's data-parallel wrap."""
    from kasoku.distributed.ddp import unwrap
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [(torch.randn(batch, 3, 64, 64, generator=g, device=dev),
                torch.randint(0, 10, (batch,), generator=g, device=dev)) for _ in range(3)]
    start = small_resnet().state_dict()
    got = {}
    for deferred in (False, True):
        acc = accelerate(small_resnet(), F.cross_entropy, None,
                         AccelConfig(**{**cfg.__dict__, "wgrad_stream": deferred}), dev,
                         lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl),
                         distribute=distribute() if distribute else None)
        assert any(type(m) is WgradStreamConv2d for m in acc.model.modules()) == deferred
        for i in range(steps):
            acc.step_fn(acc.model, batches[i % 2], acc.optimizer)
        unwrap(acc.model).load_state_dict(start)  # in place: the graph's tensors
        acc.step_fn(acc.model, batches[2], acc.optimizer)
        torch.cuda.synchronize()
        got[deferred] = [p.grad.float().clone() for p in acc.model.parameters()]
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


class _FakeStream:
    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other) -> None:
        pass


def test_ddp_is_built_on_the_stream_its_hooks_must_run_on(monkeypatch):
    # Autograd runs a gradient accumulator, and DDP's hooks on it, on the stream it was made
    # on (DDP makes them when it is built): the second stream where a model's weight
    # gradients are made there, else the capture stream of a graphed step, else as it is.
    from kasoku.accel import compose
    side, graph, main = _FakeStream("side"), _FakeStream("graph"), _FakeStream("main")
    current = [main]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    monkeypatch.setattr(wgrad_stream, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    built_on = []

    def distribute(model):
        built_on.append(current[-1].name)
        return model

    dev = torch.device("cuda", 0)  # a device object: no GPU needed
    deferred, matmuls, plain = small_resnet(), apply_matmul_1x1(small_resnet()), small_resnet()
    assert convert(deferred) and convert(matmuls)
    assert any(isinstance(m, Conv1x1Matmul) and m.wgrad_stream for m in matmuls.modules())
    for model, graph_stream in ((deferred, graph), (matmuls, None), (plain, graph),
                                (plain, None)):
        assert compose._distributed(model, distribute, dev, graph_stream) is model
    assert built_on == ["side", "side", "graph", "main"]
    assert wgrad_stream.wgrad_side_stream(deferred, dev) is side
    assert wgrad_stream.wgrad_side_stream(plain, dev) is None


def test_no_side_stream_off_cuda_and_refused_with_sharding():
    # The stream data-parallel hooks are built on: none without CUDA.
    from kasoku.accel.compose import check_sharding
    deferred = small_resnet()
    assert convert(deferred)
    assert wgrad_stream.wgrad_side_stream(deferred, torch.device("cpu")) is None
    # FSDP2 reduce-scatters a block's gradients in its own hooks, which no stream choice orders
    # after the second stream: refused, saying what to drop.
    with pytest.raises(ConfigError, match="drop --wgrad-stream"):
        check_sharding(AccelConfig(wgrad_stream=True), "sgd")


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs CUDA and NCCL")
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_ddp_reads_side_stream_gradients_once_made(graph, monkeypatch):
    # DDP copies each gradient into its bucket and all-reduces it in hooks that run on the
    # stream its gradient accumulators were made on. Built on the main stream they read the
    # side stream's weight gradients before they were written: uninitialized memory eagerly,
    # the previous step's under a graph (research/probes/wgrad_ddp_race.py, on an H200).
    # A world of one still copies and all-reduces, so its gradients must match one stream's.
    # With DDP built on the main stream, the graph case failed on an H200 (92% of a weight's
    # elements off); the eager race showed on ResNet-50's longer kernels (the probe), rarely
    # on this small model's: eagerly, the second stream is held back before each product, so
    # that a hook not ordered after it reads the gradient before it is written. The graph case
    # builds at a second batch size too: compiled for a symbolic batch size, the two builds
    # disagreed on a 1x1 weight gradient, 87% of it, on an H200 (research/probes/
    # wgrad_ddp_order.py, each batch size in a process group of its own).
    from kasoku.distributed import World, ddp
    from kasoku.distributed.config import DistConfig
    from kasoku.distributed.fsdp import data_parallel
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dev = torch.device("cuda", 0)
    if not graph:
        real = wgrad_stream.side_stream

        def late(device):
            side = real(device)
            with torch.cuda.stream(side):
                torch.cuda._sleep(1_000_000)  # ~0.5 ms of spinning on the second stream
            return side

        monkeypatch.setattr(wgrad_stream, "side_stream", late)
    ddp.join(World(), dev, 120.0)
    try:
        cfg = AccelConfig(precision="bf16", channels_last=True, matmul_1x1=True,
                          compile=graph, optimizer_impl="fused", cuda_graph=graph)
        for batch in (64, 128) if graph else (128,):
            # DDP's eager steps, compilation, capture, replays: 16
            assert_same_gradients(cfg, dev, batch=batch, steps=16,
                                  distribute=lambda: data_parallel(DistConfig(gpus=1), dev, "bf16"))
    finally:
        ddp.leave()
