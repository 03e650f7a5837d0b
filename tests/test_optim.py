import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.core.errors import ConfigError
from kasoku.optim import make_optimizer
from kasoku.optim.lamb import LAMB
from kasoku.optim.lars import LARS


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only adds contention (70 ms per step on a busy 2-core box).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


def _train(name, impl, steps=6, lr=0.05, weight_decay=1e-3, seed=0):
    model = _model(seed)
    opt = make_optimizer(name, model.parameters(), lr, weight_decay=weight_decay, impl=impl)
    x, y = _data()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_loop_foreach_fused_give_the_same_weights(name):
    ref, _, _ = _train(name, "loop")
    for impl in ("foreach", "fused"):
        model, opt, _ = _train(name, impl)
        assert bool(opt.defaults["fused"]) == (impl == "fused")
        assert bool(opt.defaults["foreach"]) == (impl == "foreach")
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_adamw_decays_matrices_only():
    """GPT-2's and nanoGPT's groups: weight decay on the matrices, none on the biases; the
    decay decoupled (a weight with no gradient shrinks by lr x decay)."""
    model = _model()
    opt = make_optimizer("adamw", model.parameters(), 0.1, weight_decay=0.5)
    assert isinstance(opt, torch.optim.AdamW)
    decayed, kept = opt.param_groups
    assert [p.dim() for p in decayed["params"]] == [2, 2] and decayed["weight_decay"] == 0.5
    assert [p.dim() for p in kept["params"]] == [1, 1] and kept["weight_decay"] == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = list(model.parameters())
    torch.testing.assert_close(after[0], before[0] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(after[1], before[1])


def test_default_impl_is_fused_where_available():
    opt = make_optimizer("adam", _model().parameters(), 1e-3)
    assert opt.defaults["fused"] is True
    opt = make_optimizer("momentum", [{"params": list(_model().parameters())}], 0.1)
    assert opt.defaults["fused"] is True


def test_make_optimizer_refuses_bad_settings():
    params = list(_model().parameters())
    with pytest.raises(ConfigError, match="choose one of"):
        make_optimizer("rmsprop", params, 0.1)
    with pytest.raises(ConfigError, match="positive"):
        make_optimizer("sgd", params, 0.0)
    with pytest.raises(ConfigError, match="implementation"):
        make_optimizer("sgd", params, 0.1, impl="cuda")
    with pytest.raises(ConfigError, match="no fused implementation"):
        make_optimizer("lars", params, 0.1, impl="fused")
    with pytest.raises(ConfigError, match="fused adam is not available"):
        make_optimizer("adam", [torch.zeros(3, dtype=torch.int64)], 0.1, impl="fused")


@pytest.mark.parametrize("name,lr", [("lars", 2.0), ("lamb", 0.02)])
def test_lars_lamb_decrease_the_loss_and_loop_equals_foreach(name, lr):
    ref, opt, losses = _train(name, "loop", steps=30, lr=lr)
    assert not opt.param_groups[0]["foreach"]
    assert losses[-1] < 0.8 * losses[0]
    model, _, losses_fe = _train(name, "foreach", steps=30, lr=lr)
    assert losses_fe[-1] < 0.8 * losses_fe[0]
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _lars_reference(p, g, buf, lr, momentum, wd, eta, adapt):
    """One LARS step on one tensor, from the paper's Algorithm 1."""
    if adapt:
        wn, gn = p.norm(), g.norm()
        trust = eta * wn / (gn + wd * wn) if wn > 0 and gn > 0 else torch.tensor(1.0)
        d = g + wd * p
    else:
        trust, d = torch.tensor(1.0), g
    buf = momentum * buf + lr * trust * d
    return p - buf, buf


def _lamb_reference(p, g, m, v, t, lr, b1, b2, eps, wd, adapt):
    """One LAMB step on one tensor, from the paper's Algorithm 2 (Adam moments)."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    if adapt:
        u = u + wd * p
        wn, un = p.norm(), u.norm()
        trust = wn / un if wn > 0 and un > 0 else torch.tensor(1.0)
    else:
        trust = torch.tensor(1.0)
    return p - lr * trust * u, m, v


@pytest.mark.parametrize("foreach", [True, False])
def test_lars_matches_the_reference_formula(foreach):
    model = _model()
    params = [p.detach().clone() for p in model.parameters()]
    opt = LARS(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-2,
               trust_coefficient=0.01, exclude_bias_and_norm=True, foreach=foreach)
    x, y = _data()
    bufs = [torch.zeros_like(p) for p in params]
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        for i, (p, g) in enumerate(zip(params, grads)):
            params[i], bufs[i] = _lars_reference(p, g, bufs[i], 0.5, 0.9, 1e-2, 0.01,
                                                 adapt=p.ndim > 1)
        for ref, p in zip(params, model.parameters()):
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-7)
        # keep the reference in lockstep with the optimizer's rounding
        params = [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("foreach", [True, False])
def test_lamb_matches_the_reference_formula(foreach):
    model = _model()
    params = [p.detach().clone() for p in model.parameters()]
    opt = LAMB(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
               exclude_bias_and_norm=True, foreach=foreach)
    x, y = _data()
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for t in (1, 2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        for i, (p, g) in enumerate(zip(params, grads)):
            params[i], ms[i], vs[i] = _lamb_reference(p, g, ms[i], vs[i], t, 0.01, 0.9, 0.99,
                                                      1e-6, 0.1, adapt=p.ndim > 1)
        for ref, p in zip(params, model.parameters()):
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-7)
        params = [p.detach().clone() for p in model.parameters()]
    assert float(opt.state[model[0].weight]["step"]) == 2.0


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_layerwise_found_inf_skips_on_the_device_and_grad_scale_unscales(cls):
    x, y = _data()
    model = _model()
    opt = cls(model.parameters(), lr=0.1, weight_decay=1e-3, exclude_bias_and_norm=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    model[0].weight.grad[0, 0] = float("inf")
    model[2].bias.grad[1] = float("nan")
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    del opt.found_inf
    for w, p in zip(weights, model.parameters()):
        assert torch.equal(w, p)
        for k, v in opt.state[p].items():
            assert torch.equal(state[id(p)][k], v), k

    # GradScaler's contract: grads arrive multiplied by grad_scale, found_inf = 0.
    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt_twin = cls(twin.parameters(), lr=0.1, weight_decay=1e-3, exclude_bias_and_norm=True)
    opt_twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o, scale in ((model, opt, None), (twin, opt_twin, 1024.0)):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        (loss * (scale or 1.0)).backward()
        if scale is not None:
            o.grad_scale, o.found_inf = torch.tensor(scale), torch.tensor(0.0)
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_layerwise_tensor_lr_equals_float_lr(cls):
    runs = []
    for lr in (0.1, torch.tensor(0.1)):
        model = _model()
        opt = cls(model.parameters(), lr=lr)
        x, y = _data()
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append(list(model.parameters()))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_compiled_update_gives_the_loop_weights_and_keeps_its_state(name, monkeypatch):
    import kasoku.optim as optim
    # aot_eager traces the update as inductor would see it, without minutes of C++ builds.
    compile_step = optim.compile_step
    monkeypatch.setattr(optim, "compile_step", lambda opt: compile_step(opt, "aot_eager"))
    ref, _, ref_losses = _train(name, "loop")
    model, opt, losses = _train(name, "compiled")
    assert opt.step is not type(opt).step and opt.defaults["foreach"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # The traced update orders Adam's bias correction differently: float32 rounding apart.
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    state = opt.state_dict()
    assert len(state["state"]) == 4  # the optimizer's own state: snapshots unchanged


def test_compiled_is_refused_for_layerwise_optimizers():
    with pytest.raises(ConfigError, match="no compiled implementation"):
        make_optimizer("lars", _model().parameters(), 0.1, impl="compiled")
