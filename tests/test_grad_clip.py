"""Gradient clipping (``--grad-clip``, ``kasoku.train.step.ClippedUpdate``): the update is
torch's ``clip_grad_norm_`` then the optimizer's step, on the true gradients under a loss
scaler (after its unscaling), and inside a compiled optimizer step; the norm before clipping
is the step's ``main/grad_norm``. The trainer and FSDP2's sharded gradients: test_fsdp."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.loss_scale import LossScaler
from kasoku.core.errors import ConfigError
from kasoku.optim import compile_step
from kasoku.train.step import ClippedUpdate, PlainUpdate, StandardStep

MAX_NORM, LR = 0.1, 0.5


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, (torch.randn(32, 8), torch.randint(0, 4, (32,)))


def by_hand(model, batch, steps):
    """The same steps written out: backward, torch's clip, SGD."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
    return model, norms


@pytest.mark.parametrize("inner", ["plain", "loss-scaler", "compiled-step"])
def test_the_clipped_update_is_torchs_clip_then_the_step(inner):
    model, batch = model_and_batch()
    want, norms = by_hand(model, batch, steps=2)
    assert min(norms) > 2 * MAX_NORM  # the clip bites on both steps
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if inner == "compiled-step":
        optimizer = compile_step(optimizer, backend="aot_eager")
    # The loss scaler's 2^16 would leave the clip with nothing to do if it clipped before
    # unscaling: the scaled norm is far above MAX_NORM, the update 2^16 times too small.
    update = ClippedUpdate(LossScaler("cpu") if inner == "loss-scaler" else PlainUpdate(),
                           MAX_NORM)
    step = StandardStep(F.cross_entropy, update=update)
    seen = [step(model, batch, optimizer)["main/grad_norm"] for _ in range(2)]
    torch.testing.assert_close(torch.stack(seen), torch.stack(norms), rtol=1e-5, atol=0)
    for got, expected in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(optimizer._optimizer_step_pre_hooks) == 1  # registered once, not per step


def test_a_step_the_scaler_skips_is_not_clipped_and_its_norm_is_nan():
    model, batch = model_and_batch()
    before = copy.deepcopy(model.state_dict())
    # A loss 1e6 times larger under a scale of 2^127 overflows the gradients: the scaler skips
    # the update on the host (the loop SGD cannot skip it on the device), so no clip runs.
    step = StandardStep(lambda out, y: 1e6 * F.cross_entropy(out, y),
                        update=ClippedUpdate(LossScaler("cpu", 2.0 ** 127), MAX_NORM))
    seen = step(model, batch, torch.optim.SGD(model.parameters(), lr=LR))
    assert seen["main/skipped_steps"] == 1 and torch.isnan(seen["main/grad_norm"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_no_clip_no_norm_and_bad_norms_are_refused(capsys):
    model, batch = model_and_batch()
    seen = StandardStep(F.cross_entropy)(model, batch, torch.optim.SGD(model.parameters(), LR))
    assert "main/grad_norm" not in seen
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="positive, finite"):
            ClippedUpdate(PlainUpdate(), bad)
    from kasoku.cli import main
    assert main(["train", "mnist-mlp", "--synthetic", "--grad-clip", "0"]) == 2
    err = capsys.readouterr().err
    assert "--grad-clip" in err and "\n" not in err.strip()
