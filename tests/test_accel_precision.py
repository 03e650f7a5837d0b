import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.loss_scale import LossScaler, MasterWeights, PrecisionState
from kasoku.accel.notes import LeverWarning
from kasoku.accel.precision import apply_precision, build_precision
from kasoku.optim import make_optimizer
from kasoku.train.step import StandardStep

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


def accuracy(output, target):
    return (output.argmax(1) == target).float().mean()


def batch(device="cpu", n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return x.to(device), (x[:, 0, :4, :4].sum((1, 2)) > 0).long().to(device) + \
        2 * (x[:, 1].mean((1, 2)) > 0).long().to(device)


def train(plan, impl="foreach", steps=8, device="cpu", lr=0.05, data=None):
    opt = make_optimizer("momentum", plan.params, lr, impl=impl)
    step = plan.make_step(F.cross_entropy, accuracy)
    data = data or batch(device)
    return [step(plan.model, data, opt) for _ in range(steps)], opt


def test_bf16_autocast_trains_on_cpu_close_to_fp32():
    fp32, _ = train(build_precision(Net().cpu(), "fp32", "cpu"), steps=10)
    bf16, _ = train(build_precision(Net().cpu(), "bf16", "cpu"), steps=10)
    l32 = [float(o["main/loss"]) for o in fp32]
    l16 = [float(o["main/loss"]) for o in bf16]
    assert l16[-1] < 0.8 * l16[0]
    assert abs(l16[-1] - l32[-1]) < 0.05 * l32[0]
    assert set(bf16[0]) == {"main/loss", "main/accuracy"}


def test_fp32_plan_is_the_standard_step_and_turns_tf32_off():
    torch.backends.cuda.matmul.allow_tf32 = True
    plan = apply_precision(Net(), "fp32", "cpu")
    assert isinstance(plan.make_step(F.cross_entropy), StandardStep)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert plan.scaler is None and plan.extensions == []


@pytest.mark.parametrize("mode", ["tf32", "fp16", "fp16-pure"])
def test_cuda_only_modes_fall_back_to_fp32_on_cpu_with_one_warning(mode):
    notes = []
    with pytest.warns(LeverWarning, match=mode):
        plan = apply_precision(Net(), mode, "cpu", notes)
    assert plan.mode == "fp32" and plan.scaler is None and len(notes) == 1
    assert next(plan.model.parameters()).dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_precision(Net(), mode, "cpu", notes)  # no second warning
    assert len(notes) == 2


def _param_grads(model, value):
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_scaler_skips_an_overflowing_step_and_backs_off(impl):
    model = Net()
    opt = make_optimizer("momentum", model.parameters(), 0.1, impl=impl)
    scaler = LossScaler("cpu", init_scale=1024.0, growth_interval=3)
    _param_grads(model, 1024.0)
    scaler.step(opt)  # a good step: grads unscaled to 1, momentum buffers created
    weights = [p.detach().clone() for p in model.parameters()]
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    assert torch.equal(next(model.parameters()).grad, torch.ones_like(weights[0]))
    assert float(scaler.observation()["main/skipped_steps"]) == 0

    _param_grads(model, 1024.0)
    model.fc.weight.grad[0, 0] = float("inf")
    model.conv.bias.grad[0] = float("nan")
    scaler.step(opt)
    obs = scaler.observation()
    for w, m, p in zip(weights, momenta, model.parameters()):
        assert torch.equal(w, p) and torch.equal(m, opt.state[p]["momentum_buffer"])
    assert float(obs["main/loss_scale"]) == 1024.0  # the scale this step's backward used
    assert float(scaler.scale_value) == 512.0      # backoff 0.5 for the next step
    assert float(obs["main/skipped_steps"]) == 1

    for _ in range(3):  # growth_interval good steps double the scale
        _param_grads(model, 512.0)
        scaler.step(opt)
    assert float(scaler.scale_value) == 1024.0
    assert float(scaler.observation()["main/skipped_steps"]) == 1
    assert float(obs["main/skipped_steps"]) == 1  # observations are clones, not live tensors


def test_scaler_state_round_trips_through_a_weights_only_snapshot(tmp_path):
    scaler = LossScaler("cpu", init_scale=256.0)
    model = Net()
    opt = make_optimizer("momentum", model.parameters(), 0.1, impl="fused")
    _param_grads(model, float("inf"))
    scaler.step(opt)
    torch.save(PrecisionState(scaler).state_dict(), tmp_path / "s.pt")
    fresh = LossScaler("cpu")
    scale_tensor = fresh.scale_value
    PrecisionState(fresh).load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert fresh.scale_value is scale_tensor  # in place: a captured graph keeps reading it
    assert float(fresh.scale_value) == 128.0
    assert float(fresh.observation()["main/skipped_steps"]) == 1


def test_fp16_autocast_machinery_trains_on_cpu():
    # CPUs run float16 autocast slowly; apply_precision refuses it there, build_precision
    # builds it anyway so the loss-scaled step is tested here.
    outs, opt = train(build_precision(Net(), "fp16", "cpu", loss_scale_init=2.0 ** 10),
                      impl="fused", steps=10)
    losses = [float(o["main/loss"]) for o in outs]
    assert losses[-1] < 0.8 * losses[0]
    assert float(outs[-1]["main/loss_scale"]) == 2.0 ** 10
    assert float(outs[-1]["main/skipped_steps"]) == 0
    assert next(iter(opt.param_groups[0]["params"])).dtype == torch.float32


def test_fp16_pure_keeps_fp32_masters_and_fp32_batchnorm():
    model = Net()
    plan = build_precision(model, "fp16-pure", "cpu", loss_scale_init=2.0 ** 10)
    assert model.conv.weight.dtype == model.fc.weight.dtype == torch.float16
    assert model.bn.weight.dtype == model.bn.running_var.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in plan.params)
    assert plan.params[2] is model.bn.weight  # fp32 parameters are their own masters
    x, _ = batch()
    assert model(x).dtype == torch.float32  # the model casts at its boundary

    outs, opt = train(plan, impl="fused", steps=10)
    losses = [float(o["main/loss"]) for o in outs]
    assert losses[-1] < 0.8 * losses[0]
    master = plan.params[0]
    assert torch.equal(master.detach().half(), model.conv.weight.detach())

    # An overflow: masters, fp16 weights and momentum stay as they were.
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in plan.params]
    plan.scaler.scale_value.fill_(2.0 ** 40)  # fp16 gradients overflow at this scale
    obs = plan.make_step(F.cross_entropy, accuracy)(model, batch(), opt)
    assert float(obs["main/skipped_steps"]) == 1
    assert float(plan.scaler.scale_value) == 2.0 ** 39
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, plan.params))


def test_fp16_pure_masters_are_in_the_snapshot_state():
    model = Net()
    plan = build_precision(model, "fp16-pure", "cpu")
    state = plan.extensions[0].state_dict()
    other = Net(seed=1)
    plan2 = build_precision(other, "fp16-pure", "cpu")
    plan2.extensions[0].load_state_dict(state)
    assert torch.equal(plan2.params[0], plan.params[0])
    assert torch.equal(other.conv.weight, model.conv.weight)
    with pytest.raises(ValueError, match="another model"):
        MasterWeights(nn.Linear(2, 2).half().parameters()).load_state_dict(state["master"])


def test_loss_scale_observations_reach_the_log(tmp_path):
    from kasoku.data.base import ArrayDataset
    from kasoku.data.loader import SerialLoader
    from kasoku.train import Trainer
    from kasoku.train.extensions import LogReport

    model = Net()
    plan = build_precision(model, "fp16", "cpu")
    opt = make_optimizer("momentum", plan.params, 0.05, impl="fused")
    x, y = batch(n=64)
    trainer = Trainer(model, opt, SerialLoader(ArrayDataset(x, y), 16, seed=0), F.cross_entropy,
                      stop_trigger=(8, "iteration"), out=tmp_path,
                      step_fn=plan.make_step(F.cross_entropy, accuracy))
    for ext in plan.extensions:
        trainer.extend(ext)
    trainer.extend(LogReport(trigger=(4, "iteration")))
    trainer.run()
    log = trainer.get_extension("LogReport").log
    assert [e["main/loss_scale"] for e in log] == [2.0 ** 16, 2.0 ** 16]
    assert [e["main/skipped_steps"] for e in log] == [0.0, 0.0]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "fp16-pure"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam", "lars"])
def test_cuda_fp16_step_is_sync_free_and_close_to_fp32(mode, optimizer):
    device = torch.device("cuda")
    data = batch(device, n=64)
    results = {}
    for m in ("fp32", mode):
        plan = apply_precision(Net().to(device), m, device)
        impl = None if optimizer == "lars" else "fused"
        opt = make_optimizer(optimizer, plan.params, 0.05 if optimizer != "adam" else 1e-3,
                             impl=impl)
        step = plan.make_step(F.cross_entropy, accuracy)
        step(plan.model, data, opt)  # first step: lazy state initialization may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if m != "fp32" else "default")
        try:
            outs = [step(plan.model, data, opt) for _ in range(10)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[m] = [float(o["main/loss"]) for o in outs]
        if m != "fp32":
            assert float(outs[-1]["main/skipped_steps"]) == 0
    assert results[mode][-1] < results[mode][0]
    assert abs(results[mode][-1] - results["fp32"][-1]) < 0.05 * results["fp32"][0]


@cuda
@pytest.mark.gpu
def test_cuda_fp16_overflow_is_skipped_without_a_sync():
    device = torch.device("cuda")
    model = Net().to(device)
    plan = apply_precision(model, "fp16", device)
    opt = make_optimizer("momentum", plan.params, 0.05, impl="fused")
    step = plan.make_step(F.cross_entropy, accuracy)
    step(model, batch(device), opt)
    weights = [p.detach().clone() for p in model.parameters()]
    plan.scaler.scale_value.fill_(2.0 ** 100)  # the fp16 activation gradients overflow
    data = batch(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        obs = step(model, data, opt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(obs["main/skipped_steps"]) == 1
    assert float(plan.scaler.scale_value) == 2.0 ** 99
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
