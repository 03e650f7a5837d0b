"""K-FAC (kasoku.kfac): the preconditioned gradient against a dense Kronecker solve, the
KL clip, the float64 retry, layers left to the base optimizer, fp16's loss scale, exact resume,
the optimizer's groups and the refusals. The factors: tests/test_kfac_factors.py; the command
line: tests/test_kfac_cli.py; several workers: tests/test_kfac_dist.py."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from kfac_cases import EXACT, kfac_of, tiny, train_step, with_ones
from torch import nn

from kasoku.accel.config import AccelConfig
from kasoku.accel.loss_scale import LossScaler
from kasoku.core.errors import ConfigError, KasokuWarning
from kasoku.kfac import KFAC, KFACConfig, check_levers
from kasoku.kfac.eigen import EighError
from kasoku.optim import make_optimizer

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


def _raw_grads_then_precondition(model, opt, x, y, lr=0.1):
    """The raw gradient matrices, then the preconditioner's step alone (the base optimizer's
    step is not taken, so .grad holds the preconditioned gradients)."""
    F.cross_entropy(model(x), y).backward()
    raw = {name: layer.grad_matrix().double() for name, layer in
           opt.preconditioner.layers.items()}
    opt.preconditioner.step(lambda w: lr)
    return raw


def _preconditioned(opt, name):
    return opt.preconditioner.layers[name].grad_matrix().double()


@pytest.mark.parametrize("damping", [1e-2, 0.3])
def test_preconditioned_gradient_is_the_dense_kronecker_solve(damping):
    model, x, y = tiny()
    opt = kfac_of(model, KFACConfig(factor_decay=0.0, kl_clip=None, damping=damping))
    raw = _raw_grads_then_precondition(model, opt, x, y)
    for name, g in raw.items():
        s = opt.preconditioner.layers[name].state
        a, gf = s["A"].double(), s["G"].double()
        # (G (x) A + damping I) vec(V) = vec(g), vec row by row: the Fisher block's solve
        dense = torch.kron(gf, a) + damping * torch.eye(a.shape[0] * gf.shape[0],
                                                        dtype=torch.float64)
        v = torch.linalg.solve(dense, g.reshape(-1)).reshape(g.shape)
        torch.testing.assert_close(_preconditioned(opt, name), v, rtol=2e-4, atol=1e-7)
        # the same through the eigenbases built with torch.kron
        la, qa = torch.linalg.eigh(a)
        lg, qg = torch.linalg.eigh(gf)
        q = torch.kron(qg, qa)
        v2 = q @ ((q.t() @ g.reshape(-1)) / (torch.kron(lg, la) + damping))
        torch.testing.assert_close(v2.reshape(g.shape), v, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("damping", [1e-2, 0.3])
def test_inverse_method_solves_against_the_factors_each_damped(damping):
    model, x, y = tiny()
    cfg = KFACConfig(factor_decay=0.0, kl_clip=None, damping=damping, method="inverse")
    opt = kfac_of(model, cfg)
    raw = _raw_grads_then_precondition(model, opt, x, y)
    for name, g in raw.items():
        s = opt.preconditioner.layers[name].state
        assert s["LA"] is None and s["LG"] is None
        eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
        a = s["A"].double() + damping ** 0.5 * eye(s["A"].shape[0])
        gf = s["G"].double() + damping ** 0.5 * eye(s["G"].shape[0])
        v = torch.linalg.solve(torch.kron(gf, a), g.reshape(-1)).reshape(g.shape)
        torch.testing.assert_close(_preconditioned(opt, name), v, rtol=2e-4, atol=1e-7)


def test_inverse_method_retries_in_float64_then_names_the_layer(monkeypatch):
    model, x, y = tiny()
    opt = kfac_of(model, KFACConfig(kl_clip=None, inv_update_freq=1, method="inverse"))
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda m: real(m) if m.dtype ==
                        torch.float64 else (m, torch.tensor(1, dtype=torch.int32)))
    with pytest.warns(KasokuWarning, match="float64"):
        train_step(model, opt, x, y)
    assert opt.preconditioner.layers["0"].state["QA"].dtype == torch.float32
    monkeypatch.setattr(torch.linalg, "cholesky_ex",
                        lambda m: (m, torch.tensor(2, dtype=torch.int32)))
    with pytest.raises(EighError, match="layer '0'.*diverged"):
        train_step(model, opt, x, y)


def test_a_state_of_the_other_method_is_refused():
    model, x, y = tiny()
    opt = kfac_of(model, KFACConfig(inv_update_freq=1, method="inverse"))
    train_step(model, opt, x, y)
    state = opt.state_dict()
    with pytest.raises(ValueError, match="--kfac-method inverse"):
        kfac_of(model, KFACConfig(inv_update_freq=1)).load_state_dict(state)


def test_without_damping_the_solve_is_g_inverse_grad_a_inverse():
    model, x, y = tiny()
    opt = kfac_of(model, KFACConfig(factor_decay=0.0, kl_clip=None, damping=1e-9))
    g = _raw_grads_then_precondition(model, opt, x, y)["0"]
    # The first layer: the last one's G is singular (softmax gradients sum to zero).
    s = opt.preconditioner.layers["0"].state
    a, gf = s["A"].double(), s["G"].double()
    assert torch.linalg.cond(a) < 1e3 and torch.linalg.cond(gf) < 1e4
    expected = torch.linalg.solve(gf, g) @ torch.linalg.inv(a)
    torch.testing.assert_close(_preconditioned(opt, "0"), expected, rtol=2e-3, atol=1e-6)


def test_kl_clip_scales_every_layer_by_one_factor():
    model, x, y = tiny()
    free = kfac_of(model, KFACConfig(factor_decay=0.0, kl_clip=None))
    raw = _raw_grads_then_precondition(model, free, x, y, lr=0.5)
    v = {name: _preconditioned(free, name) for name in raw}
    vg = sum((v[n] * raw[n]).sum() for n in raw) * 0.5 ** 2
    kl_clip = float(vg) / 16  # the clip bites: scale 1/4
    model2, _, _ = tiny()
    clipped = kfac_of(model2, KFACConfig(factor_decay=0.0, kl_clip=kl_clip))
    _raw_grads_then_precondition(model2, clipped, x, y, lr=0.5)
    for name in raw:
        torch.testing.assert_close(_preconditioned(clipped, name), v[name] * 0.25,
                                   rtol=1e-5, atol=1e-8)


def test_eigh_failing_in_float32_is_retried_in_float64(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def eigh(m, *args, **kwargs):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")
        return real(m, *args, **kwargs)

    model, x, y = tiny()
    reference = kfac_of(model, EXACT)
    _raw_grads_then_precondition(model, reference, x, y)
    model2, _, _ = tiny()
    opt = kfac_of(model2, EXACT)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with pytest.warns(KasokuWarning, match="retried in float64"):
        _raw_grads_then_precondition(model2, opt, x, y)
    assert calls == [torch.float32, torch.float64] * 4  # A and G of two layers
    for name, layer in opt.preconditioner.layers.items():
        la, qa = real(layer.state["A"].double())
        assert layer.state["LA"].dtype == layer.state["QA"].dtype == torch.float32
        torch.testing.assert_close(layer.state["LA"], la.float().clamp(min=0))
        torch.testing.assert_close(layer.state["QA"], qa.float())
        torch.testing.assert_close(_preconditioned(opt, name), _preconditioned(reference, name),
                                   rtol=1e-4, atol=1e-7)


def test_eigh_failing_in_float64_too_names_the_layer(monkeypatch):
    def eigh(m, *args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")

    model, x, y = tiny()
    opt = kfac_of(model, EXACT)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with pytest.warns(KasokuWarning), pytest.raises(EighError, match="layer '0'.*diverged"):
        train_step(model, opt, x, y)


def test_layers_it_cannot_precondition_keep_their_gradients():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(1), nn.Linear(36, 6),
                          nn.Linear(6, 3))
    model[5].requires_grad_(False)  # frozen
    x, y = torch.randn(10, 3, 7, 7), torch.randint(0, 3, (10,))
    with pytest.warns(KasokuWarning, match="groups > 1 \\(3\\) left to the base optimizer"):
        opt = kfac_of(model, EXACT)
    assert set(opt.preconditioner.layers) == {"0", "6"}
    F.cross_entropy(model(x), y).backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert "5.weight" not in before
    opt.preconditioner.step(lambda w: 0.1)
    for name, p in model.named_parameters():
        if name.startswith(("1.", "3.")):  # batch norm, grouped convolution
            assert torch.equal(p.grad, before[name]), name
        elif name.startswith(("0.", "6.")):
            assert not torch.equal(p.grad, before[name]), name


def test_a_pass_without_a_step_is_dropped():
    # A loss-scaled step skipped for an overflow: its statistics must not enter the next.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x1, x2, y = torch.randn(8, 4) * 100, torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = kfac_of(model)
    F.cross_entropy(model(x1), y).backward()  # no step
    train_step(model, opt, x2, y)
    a = with_ones(x2)
    torch.testing.assert_close(opt.preconditioner.layers["0"].state["A"], a.t() @ a / 8)


def test_evaluation_passes_are_not_read():
    model, x, y = tiny()
    opt = kfac_of(model)
    model.eval()
    model(x)
    with torch.no_grad():
        model.train()
        model(x)
    assert all(layer.a_sum is None for layer in opt.preconditioner.layers.values())


def test_fp16_loss_scale_is_divided_out_of_g():
    model, x, y = tiny()
    plain = kfac_of(model, EXACT)
    train_step(model, plain, x, y)
    model2, _, _ = tiny()
    scaler = LossScaler("cpu", init_scale=2.0 ** 12)
    scaled = kfac_of(model2, EXACT)
    scaled.loss_scale = scaler.scale_value  # what kasoku.commands.train hands it under fp16
    scaler.zero_grad(model2, scaled)
    scaler.backward(F.cross_entropy(model2(x), y))
    scaler.step(scaled)
    for name, layer in plain.preconditioner.layers.items():
        other = scaled.preconditioner.layers[name].state
        torch.testing.assert_close(other["G"], layer.state["G"])
        torch.testing.assert_close(other["A"], layer.state["A"])
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q)


def test_channels_last_and_bf16_autocast_keep_float32_factors():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3),
                          nn.Flatten(1), nn.Linear(100, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 7, 7), torch.randint(0, 3, (6,))
    model = model.to(memory_format=torch.channels_last)
    opt = kfac_of(model, EXACT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
    loss.backward()
    opt.step()
    ref_opt = kfac_of(ref, EXACT)
    train_step(ref, ref_opt, x, y)
    for name, layer in opt.preconditioner.layers.items():
        for key, value in layer.state.items():
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), (name, key)
        ref_state = ref_opt.preconditioner.layers[name].state
        torch.testing.assert_close(layer.state["G"], ref_state["G"], rtol=0.1, atol=1e-3)
    # the first layer reads its fp32 input before autocast casts it: A is the fp32 one
    torch.testing.assert_close(opt.preconditioner.layers["0"].state["A"],
                               ref_opt.preconditioner.layers["0"].state["A"])
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


def _resume_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(1),
                         nn.Linear(36, 3))


@pytest.mark.parametrize("base", ["momentum", "adam"])
def test_resume_from_a_state_dict_is_bit_identical(base):
    cfg = KFACConfig(factor_update_freq=2, inv_update_freq=3, damping=0.01)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(8, 3, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(8)]
    whole = _resume_model()
    opt = kfac_of(whole, cfg, lr=0.05, base=base)
    for x, y in batches:
        train_step(whole, opt, x, y)
    first = _resume_model()
    opt = kfac_of(first, cfg, lr=0.05, base=base)
    for x, y in batches[:4]:  # the eigenbases in use then are from step 3, the factors from 4
        train_step(first, opt, x, y)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = _resume_model()
    opt = kfac_of(resumed, cfg, lr=0.05, base=base)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert opt.preconditioner.steps == 4
    for x, y in batches[4:]:
        train_step(resumed, opt, x, y)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_schedules_and_the_trainer_see_the_base_optimizers_groups():
    model, x, y = tiny()
    opt = make_optimizer("kfac", model.parameters(), 0.1, model=model)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.base.param_groups
    assert isinstance(opt.base, torch.optim.SGD) and opt.base.defaults["momentum"] == 0.9
    opt.param_groups[0]["lr"] = 0.02
    assert opt.base.param_groups[0]["lr"] == 0.02
    train_step(model, opt, x, y)
    state = opt.state_dict()
    opt.load_state_dict(state)  # torch's load replaces the groups list: still shared
    opt.param_groups[0]["lr"] = 0.03
    assert opt.base.param_groups[0]["lr"] == 0.03
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o))
    train_step(model, opt, x, y)
    assert seen == [opt]


@pytest.mark.parametrize("settings,match", [
    ({"damping": 0.0}, "--kfac-damping"), ({"factor_decay": 1.0}, "--kfac-factor-decay"),
    ({"kl_clip": -1.0}, "--kfac-kl-clip"), ({"inv_update_freq": 0}, "--kfac-inv-update-freq"),
    ({"factor_update_freq": 1.5}, "--kfac-factor-update-freq"), ({"base": "lamb"}, "--kfac-base"),
    ({"factor_comm_dtype": "fp8"}, "--kfac-factor-comm-dtype"),
    ({"factor_precision": "fp8"}, "--kfac-factor-precision"),
    ({"method": "svd"}, "--kfac-method")])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        KFACConfig(**settings).check()


def test_refusals():
    model, _, _ = tiny()
    with pytest.raises(ConfigError, match="pass the model"):
        make_optimizer("kfac", model.parameters(), 0.1)
    with pytest.raises(ConfigError, match="no layer to precondition"):
        bn = nn.Sequential(nn.Embedding(5, 3), nn.BatchNorm1d(3))
        KFAC(bn, torch.optim.SGD(bn.parameters(), lr=0.1))
    opt = kfac_of(model)
    with pytest.raises(ValueError, match="not K-FAC's"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    for accel, flag in ((AccelConfig(cuda_graph=True), "--cuda-graph"),
                        (AccelConfig(compile=True), "--compile"),
                        (AccelConfig(precision="fp16-pure"), "fp16-pure")):
        with pytest.raises(ConfigError, match=f"{flag} with --optimizer kfac"):
            check_levers(accel)

