"""``--optimizer-impl triton``: the one-kernel Adam against torch's Adam. On a CPU the real
kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``; skipped when Triton is not
installed); on CUDA it runs compiled, eagerly and inside a whole-step CUDA graph."""
import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.triton_adam import TritonAdam
from kasoku.core.errors import ConfigError
from kasoku.optim import make_optimizer

SHAPES = [(40, 17), (40,), (3, 40), (3,), (6, 5, 3, 3)]


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tensors(device="cpu", channels_last=False):
    torch.manual_seed(0)
    out = [torch.randn(s, device=device, requires_grad=True) for s in SHAPES]
    if channels_last:
        out[-1] = out[-1].detach().to(memory_format=torch.channels_last).requires_grad_()
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("channels_last", [False, True])
def test_matches_torch_adam_over_steps(interpreter, weight_decay, channels_last):
    ref_params, params = _tensors(), _tensors(channels_last=channels_last)
    ref = torch.optim.Adam(ref_params, lr=1e-2, weight_decay=weight_decay)
    # block 64: several blocks per tensor, the last one partial.
    opt = TritonAdam(params, lr=1e-2, weight_decay=weight_decay, block=64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        for a, b in zip(ref_params, params):
            # Fresh gradient tensors each step, as backward makes them: the kernel's address
            # table must follow them.
            g = torch.randn(a.shape, generator=gen)
            a.grad = g
            b.grad = g.clone().to(memory_format=torch.channels_last) \
                if g.dim() == 4 and channels_last else g.clone()
        ref.step()
        opt.step()
    for a, b in zip(ref_params, params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(opt.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-8)
        assert float(opt.state[b]["step"]) == 8.0


def test_groups_tensor_lr_schedule_and_parameters_without_grad(interpreter):
    def groups(params, lr0):
        return [{"params": params[:2], "lr": lr0},
                {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]

    ref_params, params = _tensors(), _tensors()
    ref = torch.optim.Adam(groups(ref_params, 1e-2))
    opt = TritonAdam(groups(params, torch.tensor(1e-2)), block=32)
    for k in range(6):
        gen = torch.Generator().manual_seed(k)
        for ps in (ref_params, params):
            gen.manual_seed(k)
            for i, p in enumerate(ps):
                # The bias gets no gradient on odd steps: skipped, its step count stays behind.
                p.grad = None if (i == 1 and k % 2) else torch.randn(p.shape, generator=gen)
        lr = 1e-2 / (k + 1)  # a schedule: the float group's rate changes every step
        ref.param_groups[1]["lr"] = opt.param_groups[1]["lr"] = lr
        ref.param_groups[0]["lr"] = 1e-2 * 0.5 ** k
        opt.param_groups[0]["lr"].fill_(1e-2 * 0.5 ** k)  # a device-side schedule writes in place
        ref.step()
        opt.step()
    for a, b in zip(ref_params, params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6)
    assert float(opt.state[params[1]]["step"]) == 3.0


def test_state_dict_moves_between_torch_adam_and_triton_adam(interpreter):
    """A snapshot from torch's Adam (step counters on the host) resumes under TritonAdam, and
    TritonAdam's snapshot resumes under torch's Adam, both as if never interrupted."""
    def train(opt, params, seed, steps=4):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    whole = _tensors()
    whole_opt = torch.optim.Adam(whole, lr=1e-2)
    for seed in (1, 2, 3):
        train(whole_opt, whole, seed)

    first = _tensors()
    first_opt = torch.optim.Adam(first, lr=1e-2)
    train(first_opt, first, 1)
    second = [p.detach().clone().requires_grad_() for p in first]
    second_opt = TritonAdam(second, lr=1e-2, block=64)
    second_opt.load_state_dict(copy.deepcopy(first_opt.state_dict()))
    train(second_opt, second, 2)
    third = [p.detach().clone().requires_grad_() for p in second]
    third_opt = torch.optim.Adam(third, lr=1e-2)
    third_opt.load_state_dict(copy.deepcopy(second_opt.state_dict()))
    train(third_opt, third, 3)
    for a, b in zip(whole, third):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6)


def test_make_optimizer_builds_it_for_adam_and_refuses_it_elsewhere(interpreter):
    params = _tensors()
    opt = make_optimizer("adam", params, 1e-3, weight_decay=1e-4, impl="triton")
    assert isinstance(opt, TritonAdam) and opt.defaults["weight_decay"] == 1e-4
    with pytest.raises(ConfigError, match="adam only"):
        make_optimizer("momentum", _tensors(), 0.1, impl="triton")


@pytest.mark.parametrize("case, reason", [
    ("cpu", "it needs CUDA parameters, and these are on cpu"),
    ("float64", "it updates float32 parameters only, and these include torch.float64"),
    ("no triton", "Triton is not installed"),
])
def test_where_it_cannot_run_the_update_is_torchs_own_warned_once(case, reason, monkeypatch):
    from kasoku.accel.notes import LeverWarning, reset_warnings
    if case != "no triton":
        pytest.importorskip("triton")
    reset_warnings()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if case == "no triton":
        monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    params = [torch.zeros(3, dtype=torch.float64 if case == "float64" else torch.float32,
                          requires_grad=True)]
    with pytest.warns(LeverWarning, match=f"optimizer_impl triton: {reason}.*runs as the fused"):
        opt = make_optimizer("adam", params, 1e-3, impl="triton")
    assert type(opt) is torch.optim.Adam and opt.defaults["fused"]
    with pytest.raises(ConfigError, match=reason):  # the class itself, asked directly, refuses
        TritonAdam(params)


def test_a_gradient_laid_out_unlike_its_parameter_is_refused_with_advice(interpreter):
    p = torch.zeros(4, 6, requires_grad=True)
    opt = TritonAdam([p])
    p.grad = torch.ones(6, 4).t()  # same shape, transposed strides
    with pytest.raises(RuntimeError, match="not laid out alike.*optimizer-impl fused"):
        opt.step()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_kernel_matches_torch_adam_eagerly_and_in_a_whole_step_graph():
    from kasoku.accel import triton_adam
    from kasoku.accel.graph import CudaGraphStep, prepare_optimizer_for_graph
    from kasoku.train.step import StandardStep

    # As kasoku train does (a device without an index); the first step waits for it.
    triton_adam.compile_early(torch.device("cuda"), weight_decay=True)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)).cuda()

    torch.manual_seed(1)
    batches = [(torch.randn(32, 20, device="cuda"), torch.randint(0, 5, (32,), device="cuda"))
               for _ in range(12)]
    step = StandardStep(F.cross_entropy)
    results = []
    for impl, graphed in (("fused", False), ("triton", False), ("triton", True)):
        net = model()
        opt = make_optimizer("adam", net.parameters(), 1e-3, weight_decay=1e-4, impl=impl)
        run = step
        if graphed:
            prepare_optimizer_for_graph(opt, "cuda")
            run = CudaGraphStep(step, "cuda", warmup_steps=3)
        losses = [float(run(net, b, opt)["main/loss"]) for b in batches]
        if graphed:
            assert run.replays == 12 - 3  # the capture call replays once, too
        results.append((losses, [p.detach().clone() for p in net.parameters()]))
    assert triton_adam.AHEAD_FAILURES == []
    (ref_losses, ref_params), *others = results
    for losses, params in others:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for a, b in zip(ref_params, params):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_copy_steps_on_its_own_tensors(interpreter):
    params = _tensors()
    opt = TritonAdam(params, lr=1e-2, block=32, num_warps=2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    twin = copy.deepcopy({"params": params, "opt": opt})
    assert (twin["opt"].block, twin["opt"].num_warps) == (32, 2)
    twin["opt"].step()  # its own tables, built for the copied tensors
    opt.step()
    for a, b in zip(params, twin["params"]):
        torch.testing.assert_close(b, a)
    assert float(twin["opt"].state[twin["params"][0]]["step"]) == 2.0
