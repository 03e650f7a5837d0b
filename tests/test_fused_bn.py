"""The fused batch norm + residual + ReLU kernels (kasoku.accel.fused_bn) against the same
layer in PyTorch ops: outputs, every gradient, running statistics, under torch.compile, in a
ResNet's training step; on the CPU through Triton's interpreter, and on CUDA where there is
one."""
import pytest
import torch
import torch.nn.functional as F

from kasoku.accel import fused_bn
from kasoku.accel.compose import check_config
from kasoku.accel.config import AccelConfig
from kasoku.accel.fused_bn import FusedBatchNormAct2d, apply_fused_bn, fusable
from kasoku.accel.notes import reset_warnings
from kasoku.core.errors import ConfigError
from kasoku.models.norm import BatchNormAct2d
from kasoku.models.resnet import Bottleneck, ResNet, resnet50

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def kernels_at_every_size(monkeypatch):
    """The tests' small layers through the kernels (by default those under
    ``MIN_ELEMENTS`` keep PyTorch's ops: test_small_layers_keep_pytorch_ops)."""
    monkeypatch.setattr(fused_bn, "MIN_ELEMENTS", 0)


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = _interpreter_cannot_loop()
    if reason:
        pytest.skip(reason)


def _interpreter_cannot_loop() -> str | None:
    """Why Triton's interpreter here cannot run a loop with bounds known at run time (the
    kernels' loops over rows), or None. (Triton 3.6's interpreter under NumPy 2 cannot: it
    turns a one-element array into a Python int, which NumPy 2 refuses.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def count(out, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except Exception as e:  # the interpreter's own error, whatever its type
        return f"Triton {triton.__version__}'s interpreter cannot run the kernels' loops: {e!r}"
    return None if int(out) == 3 else "Triton's interpreter miscounts a loop"


def layer(channels, relu, fused, seed=1, device="cpu"):
    torch.manual_seed(seed)
    m = (FusedBatchNormAct2d if fused else BatchNormAct2d)(channels, relu=relu)
    m.weight.data.uniform_(0.5, 1.5)
    m.bias.data.uniform_(-0.5, 0.5)
    m.running_var.uniform_(0.5, 2.0)
    return m.to(device)


def nhwc(t):
    return t.contiguous(memory_format=torch.channels_last)


def forward_backward(m, x, r, dy, dtype=None):
    """Output and gradients (x, weight, bias, residual) of one training call, as float32."""
    dtype = dtype or x.dtype
    x = x.to(dtype).detach().requires_grad_()
    r = r.to(dtype).detach().requires_grad_() if r is not None else None
    y = m(x, r)
    y.backward(dy.to(dtype))
    grads = [x.grad, m.weight.grad, m.bias.grad] + ([r.grad] if r is not None else [])
    return [y.float()] + [g.float() for g in grads]


@pytest.mark.parametrize("relu,residual", [(True, False), (True, True), (False, False)])
def test_kernels_equal_pytorch_ops_in_float32(interpreter, relu, residual):
    # 80 channels: a partial tile of channels; 4 x 16 x 16 = 1,024 rows: several programs
    # sum into each channel (atomics) and the apply kernels cover the rows in several blocks.
    g = torch.Generator().manual_seed(0)
    shape = (4, 80, 16, 16)
    x = nhwc(torch.randn(shape, generator=g) * 2 + 3)
    r = nhwc(torch.randn(shape, generator=g)) if residual else None
    dy = nhwc(torch.randn(shape, generator=g))
    ref, fus = layer(80, relu, False), layer(80, relu, True)
    want = forward_backward(ref, x, r, dy)
    got = forward_backward(fus, x, r, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fus.running_mean, ref.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fus.running_var, ref.running_var, atol=1e-6, rtol=1e-5)
    assert int(fus.num_batches_tracked) == int(ref.num_batches_tracked) == 1


def test_variance_is_exact_for_a_large_mean(interpreter):
    # Sums of squares of raw values would lose the variance of 1 beside a mean of 1,000 in
    # float32; the kernels sum values shifted by the first row's.
    g = torch.Generator().manual_seed(0)
    x = nhwc(torch.randn(8, 16, 8, 8, generator=g, dtype=torch.float64) + 1000.0)
    m = layer(16, relu=False, fused=True)
    m.momentum = 1.0  # running_var becomes the batch's unbiased variance
    m(x.float())
    want = x.permute(1, 0, 2, 3).reshape(16, -1).var(dim=1)
    torch.testing.assert_close(m.running_var.double(), want, atol=0, rtol=1e-4)


def test_bfloat16_is_nearer_float32_than_pytorch_bfloat16_is(interpreter):
    # The kernels compute in float32 and round once; PyTorch's CPU ops round bf16 on the way.
    g = torch.Generator().manual_seed(0)
    shape = (3, 80, 5, 7)
    x, r, dy = (nhwc(torch.randn(shape, generator=g)).bfloat16().float() for _ in range(3))
    exact = forward_backward(layer(80, True, False), x, r, dy)
    got = forward_backward(layer(80, True, True), x, r, dy, torch.bfloat16)
    for a, b in zip(got, exact):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_calls_the_kernels_cannot_take_run_as_pytorch_ops(interpreter):
    m = layer(8, True, True)
    x = torch.randn(2, 8, 4, 4)
    assert not fusable(m, x, None)                         # NCHW
    assert fusable(m, nhwc(x), None)
    assert not fusable(m, nhwc(x).double(), None)          # float64
    assert not fusable(m, nhwc(x), torch.randn(2, 8, 2, 2))  # residual of another shape
    m.eval()
    assert not fusable(m, nhwc(x), None)                   # running statistics are used
    ref = layer(8, True, False).eval()
    torch.testing.assert_close(m(nhwc(x)), ref(nhwc(x)))
    m.train()
    m.momentum = None                                      # cumulative average: host count
    assert not fusable(m, nhwc(x), None)


def test_small_layers_keep_pytorch_ops(interpreter, monkeypatch):
    monkeypatch.setattr(fused_bn, "MIN_ELEMENTS", 1 << 21)
    m = layer(64, True, True)
    assert fusable(m, nhwc(torch.empty(8, 64, 64, 64)), None)      # 2**21 elements
    small = nhwc(torch.randn(8, 64, 63, 64))
    assert not fusable(m, small, None)
    torch.testing.assert_close(m(small), layer(64, True, False)(small))


def test_without_the_interpreter_cpu_tensors_take_pytorch_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = layer(8, True, True)
    assert not fusable(m, nhwc(torch.randn(2, 8, 4, 4)), None)


def test_apply_fused_bn_routes_the_resnet_layers_or_says_why_not(interpreter, monkeypatch):
    reset_warnings()
    model = resnet50(10)
    keys = list(model.state_dict())
    notes = []
    assert apply_fused_bn(model, "cpu", notes) is model and notes == []
    layers = [m for m in model.modules() if isinstance(m, BatchNormAct2d)]
    assert len(layers) == 53 and all(type(m) is FusedBatchNormAct2d for m in layers)
    assert list(model.state_dict()) == keys

    with pytest.raises(ConfigError, match="--channels-last"):
        check_config(AccelConfig(fused_bn=True))
    notes = []
    apply_fused_bn(torch.nn.Linear(2, 2), "cpu", notes)
    assert len(notes) == 1 and "no BatchNormAct2d" in notes[0]
    monkeypatch.delenv("TRITON_INTERPRET")
    notes = []
    plain = resnet50(10)
    apply_fused_bn(plain, "cpu", notes)
    assert len(notes) == 1 and "CUDA" in notes[0]
    assert all(type(m) is BatchNormAct2d for m in plain.modules()
               if isinstance(m, BatchNormAct2d))


def tiny_resnet():
    torch.manual_seed(0)
    return nhwc_model(ResNet(Bottleneck, [1, 1, 1, 1], 10, cifar_stem=True,
                             zero_init_residual=False))


def nhwc_model(model):
    return model.to(memory_format=torch.channels_last)


def train_steps(model, steps, device="cpu"):
    """The loss of each of ``steps`` steps on seeded batches, one step per ``next`` (a
    generator: the model can be looked at between steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = nhwc(torch.randn(4, 3, 16, 16, generator=g)).to(device)
        t = torch.randint(0, 10, (4,), generator=g).to(device)
        loss = F.cross_entropy(model(x), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield loss.item()


@pytest.mark.slow  # ~14 s each through Triton's interpreter on 2 cores
@pytest.mark.parametrize("compiled", [False, True])
def test_resnet_trains_alike_with_the_kernels(interpreter, compiled):
    def fused():
        model = tiny_resnet()
        apply_fused_bn(model, "cpu")
        if compiled:
            # The ops stay whole in one graph (fullgraph: no break around them).
            model.compile(backend="aot_eager", fullgraph=True)
        return model

    # The interpreter takes seconds a step: the two models' first step is looked at, then
    # the same two go on (as fresh ones would: seeded weights and batches).
    ref, fus = tiny_resnet(), fused()
    ref_losses, fus_losses = train_steps(ref, 3), train_steps(fus, 3)
    # One step: every weight (so every gradient) and running statistic alike.
    first_ref, first_fus = next(ref_losses), next(fus_losses)
    assert first_fus == pytest.approx(first_ref, rel=1e-5)
    for (name, a), b in zip(fus.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # Three steps: the same losses. (Not the same weights to float32 rounding: this tiny
    # network, 2 x 2 maps in its last stage, turns a 1e-6 relative change of its weights
    # after one step into 1e-3 of the next update, whichever the batch norm's code.)
    assert [first_fus, *fus_losses] == pytest.approx([first_ref, *ref_losses], rel=1e-3)


def test_state_dict_keys_are_those_of_batchnorm2d():
    m = BatchNormAct2d(4)
    assert list(m.state_dict()) == list(torch.nn.BatchNorm2d(4).state_dict())
    assert "relu=True" in repr(m)


def test_programmatic_dependent_launch_only_where_it_can_run(monkeypatch):
    from kasoku.accel import bn_kernels
    cpu = torch.device("cpu")
    assert bn_kernels.PDL is None and bn_kernels.launch_options(cpu) == {}
    monkeypatch.setattr(bn_kernels, "PDL", True)  # forced on: still never in the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bn_kernels.launch_options(cpu) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bn_kernels.launch_options(cpu) == {"GDC": True, "launch_pdl": True}


@cuda
@pytest.mark.parametrize("pdl", [None, False])
@pytest.mark.parametrize("relu,residual", [(True, False), (True, True), (False, False)])
def test_cuda_kernels_in_bfloat16_against_float32(relu, residual, pdl, monkeypatch):
    from kasoku.accel import bn_kernels
    monkeypatch.setattr(bn_kernels, "PDL", pdl)  # None: PDL where the GPU has it
    g = torch.Generator().manual_seed(0)
    shape = (32, 256, 14, 14)
    x, r, dy = (nhwc(torch.randn(shape, generator=g) * 2 + 1).bfloat16().float().cuda()
                for _ in range(3))
    r = r if residual else None
    exact = forward_backward(layer(256, relu, False, device="cuda"), x, r, dy)
    fus = layer(256, relu, True, device="cuda")
    got = forward_backward(fus, x, r, dy, torch.bfloat16)
    for a, b in zip(got, exact):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    # float32 against float32, element by element, on fewer elements: among 1.6M some
    # pre-activations lie within rounding of 0, where the two computations may put the ReLU's
    # edge on either side (one such element shifts its channel's whole gradient a little).
    small = [t[:4, :, :7, :7] for t in (x, dy)] + ([r[:4, :, :7, :7]] if residual else [None])
    exact = forward_backward(layer(256, relu, False, device="cuda"), small[0], small[2],
                             small[1])
    got32 = forward_backward(layer(256, relu, True, device="cuda"), small[0], small[2],
                             small[1])
    for a, b in zip(got32, exact):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@cuda
def test_cuda_resnet_compiled_and_graphed_trains_alike():
    from kasoku.accel.compose import accelerate
    from kasoku.optim import make_optimizer

    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = ResNet(Bottleneck, [1, 1, 1, 1], 10, cifar_stem=True, zero_init_residual=False)
        cfg = AccelConfig(precision="bf16", channels_last=True, optimizer_impl="fused",
                          compile=True, cuda_graph=True, fused_bn=fused)
        acc = accelerate(model, F.cross_entropy, None, cfg, "cuda",
                         lambda params, impl: make_optimizer("momentum", params, 0.05,
                                                             impl=impl))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(6, 32, 3, 16, 16, generator=g).cuda()
        t = torch.randint(0, 10, (6, 32), generator=g).cuda()
        runs.append([float(acc.step_fn(acc.model, (x[i], t[i]), acc.optimizer)["main/loss"])
                     for i in range(6)])
    assert runs[1] == pytest.approx(runs[0], rel=2e-2)
