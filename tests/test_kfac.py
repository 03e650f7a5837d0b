"""K-FAC (kasoku.kfac): the factors against per-example outer products computed here, the
preconditioned gradient against a dense Kronecker solve, the float64 retry, layers left to the
base optimizer, fp16's loss scale, exact resume, the refusals, and ``kasoku train --optimizer
kfac`` end to end."""
import copy
import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.config import AccelConfig
from kasoku.accel.loss_scale import LossScaler
from kasoku.errors import ConfigError, KasokuWarning, reset_warnings
from kasoku.kfac import KFAC, KFACConfig, check_levers
from kasoku.kfac.eigen import EighError
from kasoku.optim import make_optimizer
from kasoku.train import load_snapshot


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only adds contention on a shared 2-core box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    reset_warnings()
    yield
    torch.set_num_threads(before)


EXACT = KFACConfig(factor_decay=0.0, kl_clip=None, factor_update_freq=1, inv_update_freq=1)
"""Factors = this batch's, eigenbases of them, no clipping: what the direct computations give."""


def _kfac(model, cfg=EXACT, lr=0.1, base="sgd"):
    if base == "adam":
        return KFAC(model, torch.optim.Adam(model.parameters(), lr=lr), cfg)
    momentum = 0.9 if base == "momentum" else 0.0
    return KFAC(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), cfg)


def _per_example_output_grads(model, layer, x, y):
    """``d loss_n / d (layer output of example n)`` for each example, one example at a time
    (the loss of one example is its own cross-entropy: the mean over a batch of one)."""
    grads = []

    def keep(module, args, output):
        output.retain_grad()
        out["y"] = output
        return output.clone()  # an in-place ReLU after the layer changes the clone

    for n in range(len(x)):
        out = {}
        handle = layer.register_forward_hook(keep)
        F.cross_entropy(model(x[n:n + 1]), y[n:n + 1]).backward()
        handle.remove()
        grads.append(out["y"].grad[0].clone())
        model.zero_grad(set_to_none=True)
    return torch.stack(grads)


def _layer_inputs(model, layer, x):
    out = {}
    handle = layer.register_forward_pre_hook(lambda m, args: out.__setitem__("a", args[0]))
    with torch.no_grad():
        model(x)
    handle.remove()
    return out["a"].detach()


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _ones(a):
    return torch.cat([a, torch.ones(len(a), 1)], dim=1)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_factors_are_the_mean_per_example_outer_products(bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.ReLU(inplace=True),
                          nn.Linear(7, 3, bias=bias))
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    expected = {}
    for name in ("0", "2"):
        layer = model.get_submodule(name)
        a = _layer_inputs(model, layer, x)
        a = _ones(a) if bias else a
        d = _per_example_output_grads(model, layer, x, y)
        expected[name] = (torch.einsum("ni,nj->ij", a, a) / len(x),
                          torch.einsum("ni,nj->ij", d, d) / len(x))
    opt = _kfac(model)
    _step(model, opt, x, y)
    layers = opt.preconditioner.layers
    assert set(layers) == {"0", "2"}
    for name, (a, g) in expected.items():
        state = layers[name].state
        assert state["A"].dtype == state["G"].dtype == torch.float32
        torch.testing.assert_close(state["A"], a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["G"], g, rtol=1e-5, atol=1e-7)


def _patches(x, conv):
    """Each output position's input patch, by slicing the padded input: ``[N, S, C*kh*kw]``
    (the order of ``conv.weight.flatten(1)``)."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    ph, pw = conv.padding
    xp = F.pad(x, (pw, pw, ph, ph))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = []
    for i in range(oh):
        for j in range(ow):
            window = xp[:, :, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                        j * sw:j * sw + dw * (kw - 1) + 1:dw]
            out.append(window.reshape(len(x), -1))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("bias,stride,padding,dilation", [
    (True, 1, 1, 1), (False, 2, (1, 2), 1), (True, 1, (2, 1), 2)])
def test_conv_factors_are_patch_outer_products_averaged_over_positions(bias, stride, padding,
                                                                         dilation):
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 4, 3, stride=stride, padding=padding, dilation=dilation, bias=bias)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(1), nn.LazyLinear(5))
    x, y = torch.randn(6, 3, 7, 8), torch.randint(0, 5, (6,))
    model(x)  # the lazy layer takes its shape
    p = _patches(x, conv)
    n, s = p.shape[:2]
    rows = p.reshape(n * s, -1)
    rows = _ones(rows) if bias else rows
    a = rows.t() @ rows / (n * s)
    d = _per_example_output_grads(model, conv, x, y).flatten(2).transpose(1, 2)  # [N, S, out]
    g = torch.einsum("nso,nsp->op", d, d) / n
    # The patch order is the weight's: the mean loss's weight gradient is sum_s d p^T / N.
    F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(conv.weight.grad.flatten(1),
                               torch.einsum("nso,nsk->ok", d, p) / n, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    opt = _kfac(model)
    _step(model, opt, x, y)
    state = opt.preconditioner.layers["0"].state
    torch.testing.assert_close(state["A"], a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["G"], g, rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("kwargs", [
    {"kernel_size": 4, "padding": "same"},  # the odd pixel on the right and bottom
    {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    {"kernel_size": 3, "padding": (2, 1), "padding_mode": "circular", "dilation": 2,
     "stride": 2}])
def test_conv_patches_are_what_the_convolution_multiplies(kwargs):
    # The weight gradient is sum over examples and positions of d p^T: it holds only for the
    # patches the convolution really multiplies, whatever its padding.
    from kasoku.kfac.factors import _patch_columns
    torch.manual_seed(7)
    conv = nn.Conv2d(3, 4, bias=False, **kwargs)
    x = torch.randn(5, 3, 8, 9)
    y = conv(x)
    d = torch.randn_like(y)
    (y * d).sum().backward()
    cols = _patch_columns(conv, x)
    torch.testing.assert_close(conv.weight.grad.flatten(1),
                               d.transpose(0, 1).reshape(4, -1) @ cols.t(),
                               rtol=1e-4, atol=1e-5)


def test_running_average_starts_at_the_identity():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    y = torch.randint(0, 3, (8,))
    opt = _kfac(model, KFACConfig(factor_decay=0.75, kl_clip=None))
    batches = []
    for x in (x1, x2):
        a = _ones(x)
        batches.append(a.t() @ a / len(x))
        _step(model, opt, x, y)
    expected = (torch.eye(5) * 0.75 + batches[0] * 0.25) * 0.75 + batches[1] * 0.25
    torch.testing.assert_close(opt.preconditioner.layers["0"].state["A"], expected)


def _tiny():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))
    return model, torch.randn(32, 3), torch.randint(0, 2, (32,))


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
    model, x, y = _tiny()
    opt = _kfac(model, KFACConfig(factor_decay=0.0, kl_clip=None, damping=damping))
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


def test_without_damping_the_solve_is_g_inverse_grad_a_inverse():
    model, x, y = _tiny()
    opt = _kfac(model, KFACConfig(factor_decay=0.0, kl_clip=None, damping=1e-9))
    g = _raw_grads_then_precondition(model, opt, x, y)["0"]
    # The first layer: the last one's G is singular (softmax gradients sum to zero).
    s = opt.preconditioner.layers["0"].state
    a, gf = s["A"].double(), s["G"].double()
    assert torch.linalg.cond(a) < 1e3 and torch.linalg.cond(gf) < 1e4
    expected = torch.linalg.solve(gf, g) @ torch.linalg.inv(a)
    torch.testing.assert_close(_preconditioned(opt, "0"), expected, rtol=2e-3, atol=1e-6)


def test_kl_clip_scales_every_layer_by_one_factor():
    model, x, y = _tiny()
    free = _kfac(model, KFACConfig(factor_decay=0.0, kl_clip=None))
    raw = _raw_grads_then_precondition(model, free, x, y, lr=0.5)
    v = {name: _preconditioned(free, name) for name in raw}
    vg = sum((v[n] * raw[n]).sum() for n in raw) * 0.5 ** 2
    kl_clip = float(vg) / 16  # the clip bites: scale 1/4
    model2, _, _ = _tiny()
    clipped = _kfac(model2, KFACConfig(factor_decay=0.0, kl_clip=kl_clip))
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

    model, x, y = _tiny()
    reference = _kfac(model, EXACT)
    _raw_grads_then_precondition(model, reference, x, y)
    model2, _, _ = _tiny()
    opt = _kfac(model2, EXACT)
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

    model, x, y = _tiny()
    opt = _kfac(model, EXACT)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with pytest.warns(KasokuWarning), pytest.raises(EighError, match="layer '0'.*diverged"):
        _step(model, opt, x, y)


def test_layers_it_cannot_precondition_keep_their_gradients():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(1), nn.Linear(36, 6),
                          nn.Linear(6, 3))
    model[5].requires_grad_(False)  # frozen
    x, y = torch.randn(10, 3, 7, 7), torch.randint(0, 3, (10,))
    with pytest.warns(KasokuWarning, match="groups > 1 \\(3\\) left to the base optimizer"):
        opt = _kfac(model, EXACT)
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
    opt = _kfac(model)
    F.cross_entropy(model(x1), y).backward()  # no step
    _step(model, opt, x2, y)
    a = _ones(x2)
    torch.testing.assert_close(opt.preconditioner.layers["0"].state["A"], a.t() @ a / 8)


def test_evaluation_passes_are_not_read():
    model, x, y = _tiny()
    opt = _kfac(model)
    model.eval()
    model(x)
    with torch.no_grad():
        model.train()
        model(x)
    assert all(layer.a_sum is None for layer in opt.preconditioner.layers.values())


def test_fp16_loss_scale_is_divided_out_of_g():
    model, x, y = _tiny()
    plain = _kfac(model, EXACT)
    _step(model, plain, x, y)
    model2, _, _ = _tiny()
    scaler = LossScaler("cpu", init_scale=2.0 ** 12)
    scaled = _kfac(model2, EXACT)
    scaled.loss_scale = scaler.scale_value  # what kasoku.run hands it under fp16
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
    opt = _kfac(model, EXACT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
    loss.backward()
    opt.step()
    ref_opt = _kfac(ref, EXACT)
    _step(ref, ref_opt, x, y)
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
    opt = _kfac(whole, cfg, lr=0.05, base=base)
    for x, y in batches:
        _step(whole, opt, x, y)
    first = _resume_model()
    opt = _kfac(first, cfg, lr=0.05, base=base)
    for x, y in batches[:4]:  # the eigenbases in use then are from step 3, the factors from 4
        _step(first, opt, x, y)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = _resume_model()
    opt = _kfac(resumed, cfg, lr=0.05, base=base)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert opt.preconditioner.steps == 4
    for x, y in batches[4:]:
        _step(resumed, opt, x, y)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_schedules_and_the_trainer_see_the_base_optimizers_groups():
    model, x, y = _tiny()
    opt = make_optimizer("kfac", model.parameters(), 0.1, model=model)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.base.param_groups
    assert isinstance(opt.base, torch.optim.SGD) and opt.base.defaults["momentum"] == 0.9
    opt.param_groups[0]["lr"] = 0.02
    assert opt.base.param_groups[0]["lr"] == 0.02
    _step(model, opt, x, y)
    state = opt.state_dict()
    opt.load_state_dict(state)  # torch's load replaces the groups list: still shared
    opt.param_groups[0]["lr"] = 0.03
    assert opt.base.param_groups[0]["lr"] == 0.03
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o))
    _step(model, opt, x, y)
    assert seen == [opt]


@pytest.mark.parametrize("settings,match", [
    ({"damping": 0.0}, "--kfac-damping"), ({"factor_decay": 1.0}, "--kfac-factor-decay"),
    ({"kl_clip": -1.0}, "--kfac-kl-clip"), ({"inv_update_freq": 0}, "--kfac-inv-update-freq"),
    ({"factor_update_freq": 1.5}, "--kfac-factor-update-freq"), ({"base": "lamb"}, "--kfac-base"),
    ({"factor_comm_dtype": "fp8"}, "--kfac-factor-comm-dtype")])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        KFACConfig(**settings).check()


def test_refusals():
    model, _, _ = _tiny()
    with pytest.raises(ConfigError, match="pass the model"):
        make_optimizer("kfac", model.parameters(), 0.1)
    with pytest.raises(ConfigError, match="no layer to precondition"):
        bn = nn.Sequential(nn.Embedding(5, 3), nn.BatchNorm1d(3))
        KFAC(bn, torch.optim.SGD(bn.parameters(), lr=0.1))
    opt = _kfac(model)
    with pytest.raises(ValueError, match="not K-FAC's"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    for accel, flag in ((AccelConfig(cuda_graph=True), "--cuda-graph"),
                        (AccelConfig(compile=True), "--compile"),
                        (AccelConfig(precision="fp16-pure"), "fp16-pure")):
        with pytest.raises(ConfigError, match=f"{flag} with --optimizer kfac"):
            check_levers(accel)


# --- the command line -------------------------------------------------------------------
def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("# ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_refuses_levers_and_bad_values_in_one_line(tmp_path, capsys):
    from kasoku.cli import main
    base = ["train", "mnist-mlp", "--synthetic", "--optimizer", "kfac", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main([*base, "--cuda-graph"]) == 2
    assert "--cuda-graph with --optimizer kfac" in _one_line(capsys.readouterr().err)
    assert main([*base, "--kfac-factor-decay", "1"]) == 2
    assert "--kfac-factor-decay" in _one_line(capsys.readouterr().err)
    # Refused before any worker starts (data-parallel K-FAC itself: tests/test_kfac_dist.py).
    assert main([*base, "--procs", "2", "--compile"]) == 2
    assert "--compile with --optimizer kfac" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_cli_trains_mnist_mlp_with_kfac_and_the_loss_falls(tmp_path, capsys):
    from kasoku.cli import main
    out = tmp_path / "run"
    assert main(["train", "mnist-mlp", "--synthetic", "--synthetic-size", "300",
                 "--batch-size", "50", "--epochs", "2", "--optimizer", "kfac", "--lr", "0.1",
                 "--kfac-inv-update-freq", "6", "--kfac-damping", "0.003", "--threads", "1",
                 "--no-progress", "--out", str(out)]) == 0
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2]
    assert log[-1]["main/loss"] < log[0]["main/loss"] - 0.1
    state = load_snapshot(out / "snapshot_latest.pt")
    assert state["run"]["optimizer"] == "kfac"
    assert state["optimizer"]["kfac"]["steps"] == 12
    assert set(state["optimizer"]["kfac"]["layers"]) == {"net.1", "net.3", "net.5"}


def test_cli_kfac_with_channels_last_and_bf16_resumes_exactly(tmp_path, capsys):
    from kasoku.cli import main
    args = ["train", "cifar10-lenet5", "--synthetic", "--synthetic-size", "120",
            "--batch-size", "20", "--optimizer", "kfac", "--lr", "0.05", "--channels-last",
            "--precision", "bf16", "--kfac-inv-update-freq", "4", "--kfac-factor-update-freq",
            "2", "--threads", "1", "--no-progress"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*args, "--epochs", "2", "--out", str(straight)]) == 0
    assert main([*args, "--epochs", "1", "--out", str(split)]) == 0
    assert main([*args, "--epochs", "2", "--resume", str(split)]) == 0
    a = load_snapshot(straight / "snapshot_latest.pt")
    b = load_snapshot(split / "snapshot_latest.pt")
    assert a["optimizer"]["kfac"]["steps"] == b["optimizer"]["kfac"]["steps"] == 12
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for name, layer in a["optimizer"]["kfac"]["layers"].items():
        assert all(torch.equal(v, b["optimizer"]["kfac"]["layers"][name][k])
                   for k, v in layer.items()), name


def test_build_trainer_hands_the_loss_scale_to_kfac():
    from types import SimpleNamespace

    from kasoku.accel.loss_scale import PrecisionState
    from kasoku.run import _share_loss_scale
    model, _, _ = _tiny()
    scaler = LossScaler("cpu")
    accelerated = SimpleNamespace(optimizer=_kfac(model), extensions=[PrecisionState(scaler)])
    _share_loss_scale(accelerated)
    assert accelerated.optimizer.loss_scale is scaler.scale_value


def test_kfac_settings_without_kfac_are_said_to_do_nothing(tmp_path, capsys):
    from kasoku.cli import main
    assert main(["train", "sine-lstm", "--synthetic-size", "100", "--batch-size", "50",
                 "--epochs", "1", "--no-progress", "--threads", "1", "--kfac-damping", "0.01",
                 "--out", str(tmp_path / "run")]) == 0
    assert "the K-FAC settings have no effect" in capsys.readouterr().err
