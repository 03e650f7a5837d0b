"""K-FAC's factors (kasoku.kfac) against per-example outer products and convolution patches
computed here, one example at a time, and their running average."""
import pytest
import torch
import torch.nn.functional as F
from kfac_cases import kfac_of, train_step, with_ones
from torch import nn

from kasoku.kfac import KFACConfig

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


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
        a = with_ones(a) if bias else a
        d = _per_example_output_grads(model, layer, x, y)
        expected[name] = (torch.einsum("ni,nj->ij", a, a) / len(x),
                          torch.einsum("ni,nj->ij", d, d) / len(x))
    opt = kfac_of(model)
    train_step(model, opt, x, y)
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
    rows = with_ones(rows) if bias else rows
    a = rows.t() @ rows / (n * s)
    d = _per_example_output_grads(model, conv, x, y).flatten(2).transpose(1, 2)  # [N, S, out]
    g = torch.einsum("nso,nsp->op", d, d) / n
    # The patch order is the weight's: the mean loss's weight gradient is sum_s d p^T / N.
    F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(conv.weight.grad.flatten(1),
                               torch.einsum("nso,nsk->ok", d, p) / n, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    opt = kfac_of(model)
    train_step(model, opt, x, y)
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
    opt = kfac_of(model, KFACConfig(factor_decay=0.75, kl_clip=None))
    batches = []
    for x in (x1, x2):
        a = with_ones(x)
        batches.append(a.t() @ a / len(x))
        train_step(model, opt, x, y)
    expected = (torch.eye(5) * 0.75 + batches[0] * 0.25) * 0.75 + batches[1] * 0.25
    torch.testing.assert_close(opt.preconditioner.layers["0"].state["A"], expected)



def test_factor_precisions_round_the_inputs_and_keep_float32_sums():
    # On a CPU, tf32 is float32 and bf16 multiplies the bf16-rounded inputs in float32: the
    # same numbers the GPU's bf16 products with float32 outputs give. Both stay well inside
    # the damping's scale of the exact factors.
    from kasoku.kfac.factors import a_factor, g_factor
    torch.manual_seed(3)
    conv = nn.Conv2d(8, 6, 3, padding=1)
    x = torch.randn(16, 8, 10, 10)
    d = torch.randn(16, 6, 10, 10)
    exact_a, exact_g = a_factor(conv, x, True, "fp32"), g_factor(conv, d, "fp32")
    torch.testing.assert_close(a_factor(conv, x, True, "tf32"), exact_a, rtol=0, atol=0)
    torch.testing.assert_close(g_factor(conv, d, "tf32"), exact_g, rtol=0, atol=0)
    a16, g16 = a_factor(conv, x, True, "bf16"), g_factor(conv, d, "bf16")
    assert a16.dtype == g16.dtype == torch.float32
    rounded_a = a_factor(conv, x.bfloat16().float(), True, "fp32")
    torch.testing.assert_close(a16, rounded_a, rtol=1e-5, atol=1e-6)
    for approx, exact in ((a16, exact_a), (g16, exact_g)):
        error = (approx - exact).norm() / exact.norm()
        assert 0 < error < 4e-3, error  # bf16 rounds each input by at most 2^-9
    with pytest.raises(ValueError, match="factor precision"):
        a_factor(conv, x, True, "fp8")


def test_gradient_factor_of_a_channels_last_gradient_is_the_same():
    from kasoku.kfac.factors import g_factor
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 5, 3)
    d = torch.randn(4, 5, 6, 7)
    torch.testing.assert_close(g_factor(conv, d.to(memory_format=torch.channels_last)),
                               g_factor(conv, d), rtol=1e-6, atol=1e-7)
