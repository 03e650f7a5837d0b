"""The transformer's levers on CPU (issue 35): activation checkpointing (the same loss and
gradients, less memory kept for the backward pass), the attention kernel pinned, float8's
refusals, compile and the ladder on gpt."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kasoku.accel.attention import PinnedAttention, apply_sdpa_backend, check_sdpa_backend
from kasoku.accel.checkpointing import apply_activation_checkpointing
from kasoku.accel.compile import apply_compile
from kasoku.accel.compose import accelerate
from kasoku.accel.config import AccelConfig
from kasoku.accel.float8 import check_float8
from kasoku.commands.bench.rungs import Rung, parse_config, resolve
from kasoku.core.errors import ConfigError
from kasoku.distributed.fsdp import Distribute
from kasoku.models.gpt import GPT, GPT_SHAPES
from kasoku.models.mlp import MLP
from kasoku.optim import make_optimizer
from kasoku.perf.activations import saved_activation_bytes
from kasoku.train.step import markable

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")

TINY = GPT_SHAPES["tiny"]


def gpt(attention="sdpa", checkpointing="none", seed=0):
    torch.manual_seed(seed)
    return apply_activation_checkpointing(GPT(TINY, attention), checkpointing)


def tokens(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (n, TINY.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def loss_and_grads(model, x, y):
    loss = loss_of(model, x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "plain"])
def test_checkpointing_keeps_the_loss_and_gradients(attention):
    """Bit-identical: the recomputation runs the same operators on the same inputs with the
    same kernels, and autograd sums each gradient's contributions in the same order (on one
    thread, as these tests run: no kernel splits its sums differently between two calls)."""
    x, y = tokens()
    loss, grads = loss_and_grads(gpt(attention), x, y)
    for mode in ("full", "selective"):
        model = gpt(attention, mode)
        assert model.state_dict().keys() == gpt(attention).state_dict().keys()
        other_loss, other = loss_and_grads(model, x, y)
        assert torch.equal(other_loss, loss), mode
        for name, grad in grads.items():
            assert torch.equal(other[name], grad), (mode, name)


@pytest.mark.parametrize("attention", ["sdpa", "plain"])
def test_checkpointing_keeps_less_for_the_backward_pass(attention):
    x, y = tokens(8)
    kept = {}
    for mode in ("none", "selective", "full"):
        model = gpt(attention, mode)
        kept[mode] = saved_activation_bytes(model, lambda: loss_of(model, x, y), keep=(x, y))
    assert kept["none"] > kept["selective"] > kept["full"] > 0, kept
    with torch.no_grad():  # nothing is kept for a backward pass that will not run
        model = gpt(attention)
        assert saved_activation_bytes(model, lambda: loss_of(model, x, y), keep=(x, y)) == 0


def test_a_wrapper_subclass_counts_as_the_tensors_it_wraps():
    """torchao's float8 activations are wrapper subclasses with no storage of their own (the
    bench's count failed on them on a GPU); TwoTensor stands in: each holds two tensors."""
    from torch.testing._internal.two_tensor import TwoTensor
    model = torch.nn.Linear(1000, 1, bias=False)
    x = torch.randn(1000)

    def forward(wrap):
        a = x.exp()
        a = TwoTensor(a, x.exp()) if wrap else a
        return (a.sin() * model.weight[0]).sum()  # keeps sin's output for the weight's grad
    plain = saved_activation_bytes(model, lambda: forward(False), keep=(x,))
    assert plain == 4000
    assert saved_activation_bytes(model, lambda: forward(True), keep=(x,)) == 2 * plain


def test_checkpointing_is_refused_for_a_model_without_blocks():
    with pytest.raises(ConfigError, match="no `blocks` ModuleList"):
        apply_activation_checkpointing(MLP(), "full")
    with pytest.raises(ConfigError, match="checkpointed already"):
        apply_activation_checkpointing(gpt(checkpointing="full"), "selective")


def test_checkpointed_gpt_compiles_and_trains_like_the_eager_one():
    """Dynamo traces the checkpointed blocks (aot_eager: the tracing without inductor's C++
    build, which the levers' compile test already pays)."""
    x, y = tokens()
    eager = loss_of(gpt(), x, y)
    for mode in ("full", "selective"):
        model = apply_compile(gpt(checkpointing=mode), backend="aot_eager")
        loss = loss_of(model, x, y)
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=0)
        assert model.head.weight.grad is not None


def test_math_attention_is_the_plain_one():
    x, _ = tokens()
    sdpa, plain = gpt("sdpa"), gpt("plain")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(sdpa(x), plain(x), rtol=1e-5, atol=1e-6)


def test_the_pinned_backend_runs_the_step_and_cpu_refusals_are_one_line():
    acc = accelerate(gpt(), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                     None, AccelConfig(sdpa_backend="math"), "cpu",
                     lambda params, impl: make_optimizer("adamw", params, 1e-3, impl=impl))
    assert isinstance(acc.step_fn, PinnedAttention)
    assert markable(acc.step_fn) is acc.step_fn.inner  # the phase clock reaches the step
    assert torch.isfinite(acc.step_fn(acc.model, tokens(), acc.optimizer)["main/loss"])
    step = object()
    assert apply_sdpa_backend(step, "auto", "cpu") is step
    check_sdpa_backend("flash", "cpu")  # PyTorch's CPU flash kernel: what auto runs here
    for backend in ("efficient", "cudnn"):
        with pytest.raises(ConfigError, match=f"{backend}.*CUDA") as e:
            check_sdpa_backend(backend, "cpu")
        assert "\n" not in str(e.value)


def test_float8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="not cpu"):
        check_float8("rowwise", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="capability 8.0"):
        check_float8("tensorwise", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("kasoku.accel.float8.has_torchao", lambda: False)
    with pytest.raises(ConfigError, match="pip install torchao") as e:
        check_float8("rowwise", "cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="precision bf16"):
        accelerate(gpt(), F.cross_entropy, None, AccelConfig(float8="rowwise", precision="fp16"),
                   "cpu", lambda params, impl: make_optimizer("adamw", params, 1e-3, impl=impl))


def test_the_ladder_takes_the_levers_and_drops_what_cannot_apply():
    config = parse_config("bf16,fused,activation_checkpointing=selective,float8=rowwise,"
                          "sdpa_backend=efficient")
    (rung,), notes = resolve([Rung("mine", config)], "cpu", has_conv=False, has_blocks=False)
    assert (rung.config.float8, rung.config.sdpa_backend, rung.config.activation_checkpointing) \
        == ("none", "auto", "none")
    assert len(notes) == 3 and all("does not apply" in n for n in notes)
    cudnn = replace(config, sdpa_backend="cudnn")
    (rung,), notes = resolve([Rung("mine", cudnn)], "cpu", has_conv=False, has_blocks=True)
    assert rung.config.sdpa_backend == "auto" and any("sdpa_backend cudnn" in n for n in notes)
    (rung,), _ = resolve([Rung("mine", config)], "cuda", has_conv=False, has_blocks=True)
    assert rung.config == config
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        parse_config("activation_checkpointing=some")


def test_a_sharding_wrap_gets_each_block_compiled_before_it():
    """With a distribute step that ``compiles_blocks`` (``fsdp.sharder``), --compile
    compiles each block in place, before the wrap sees it, and not the whole model."""
    seen = []

    def record(model):
        seen.append([b._compiled_call_impl is not None for b in model.blocks])
        return model
    wrap = Distribute(record, compiles_blocks=True)
    adamw = lambda params, impl: make_optimizer("adamw", params, 1e-3, impl=impl)  # noqa: E731
    acc = accelerate(gpt(), F.cross_entropy, None, AccelConfig(compile=True), "cpu", adamw,
                     distribute=wrap)
    assert seen == [[True, True]]
    assert acc.model._compiled_call_impl is None
    with pytest.raises(ConfigError, match="no `blocks` ModuleList"):
        accelerate(MLP(), F.cross_entropy, None, AccelConfig(compile=True), "cpu", adamw,
                   distribute=wrap)
