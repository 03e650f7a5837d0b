"""Whole-step CUDA graph capture: numerics against the eager step, static buffers, the eager
fallback for odd-shaped batches, schedules under replay. CUDA only (skipped elsewhere; the
CPU side of the graph lever is in test_accel_levers.py)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kasoku.accel.compose import accelerate
from kasoku.accel.config import AccelConfig
from kasoku.accel.graph import CudaGraphStep, prepare_optimizer_for_graph
from kasoku.accel.notes import LeverWarning, reset_warnings
from kasoku.core.errors import ConfigError
from kasoku.optim import make_optimizer
from kasoku.train.step import StandardStep

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _setup():
    reset_warnings()
    torch.backends.cudnn.deterministic = True  # compare graph and eager kernel for kernel
    yield
    torch.backends.cudnn.deterministic = False


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def accuracy(output, target):
    return (output.argmax(1) == target).float().mean()


def batches(k, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randn(n, 3, 8, 8, generator=g)
        y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
        out.append((x.to(DEVICE), y.to(DEVICE)))
    return out


OPTIMIZERS = [("momentum", "fused", 0.05), ("adam", "fused", 1e-3), ("adam", "foreach", 1e-3),
              ("adam", "loop", 1e-3), ("lars", "foreach", 1.0), ("lamb", "foreach", 1e-2)]


def _twins(name, impl, lr):
    """Two identical models and optimizers, both prepared for capture (tensor lr,
    capturable): the only difference left between the runs is graph vs eager."""
    out = []
    for _ in range(2):
        model = Net().to(DEVICE)
        opt = make_optimizer(name, model.parameters(), lr, impl=impl)
        prepare_optimizer_for_graph(opt, DEVICE)
        out.append((model, opt))
    return out


def _run(step, model, opt, data):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable")
        return [step(model, b, opt) for b in data]


def _assert_same(model_a, model_b, obs_a, obs_b, atol=1e-5):
    for a, b in zip(obs_a, obs_b):
        torch.testing.assert_close(a["main/loss"], b["main/loss"], rtol=1e-4, atol=atol)
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name,impl,lr", OPTIMIZERS)
def test_graph_captured_step_matches_eager(name, impl, lr):
    (m1, o1), (m2, o2) = _twins(name, impl, lr)
    data = batches(10)
    step = StandardStep(F.cross_entropy, accuracy)
    eager = _run(step, m1, o1, data)
    graphed_step = CudaGraphStep(step, DEVICE)
    graphed = _run(graphed_step, m2, o2, data)
    assert graphed_step.replays == 7 and graphed_step.eager_steps == 3
    _assert_same(m1, m2, eager, graphed)
    # Clones, not the static tensors: every iteration keeps its own value.
    assert len({float(o["main/loss"]) for o in graphed}) == len(graphed)


def test_graph_replay_has_no_host_sync():
    (_, _), (model, opt) = _twins("momentum", "fused", 0.05)
    step = CudaGraphStep(StandardStep(F.cross_entropy, accuracy), DEVICE)
    data = batches(8)
    _run(step, model, opt, data[:4])  # warm-up and capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(step, model, opt, data[4:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.replays == 5


def test_odd_shaped_batch_runs_eagerly_with_one_warning():
    (m1, o1), (m2, o2) = _twins("momentum", "fused", 0.05)
    data = batches(6)
    short = batches(1, n=8, seed=1)
    data = data[:5] + short + data[5:] + short
    eager = _run(StandardStep(F.cross_entropy, accuracy), m1, o1, data)
    step = CudaGraphStep(StandardStep(F.cross_entropy, accuracy), DEVICE)
    with pytest.warns(LeverWarning, match="run eagerly") as record:
        graphed = _run(step, m2, o2, data)
    assert len([w for w in record if issubclass(w.category, LeverWarning)]) == 1
    assert step.replays == 3 and step.eager_steps == 5
    _assert_same(m1, m2, eager, graphed)


def test_schedule_changes_reach_the_replayed_graph():
    (m1, o1), (m2, o2) = _twins("momentum", "fused", 0.05)
    data = batches(10)
    rates = [0.05 * (i + 1) / 10 for i in range(10)]
    results = []
    for step, model, opt in ((StandardStep(F.cross_entropy, accuracy), m1, o1),
                             (CudaGraphStep(StandardStep(F.cross_entropy, accuracy), DEVICE),
                              m2, o2)):
        obs = []
        for rate, b in zip(rates, data):
            opt.param_groups[0]["lr"].fill_(rate)  # what kasoku's schedules do
            obs += _run(step, model, opt, [b])
        results.append(obs)
    _assert_same(m1, m2, *results)


@pytest.mark.parametrize("precision,optimizer,impl", [
    ("fp32", "momentum", "fused"), ("bf16", "momentum", "fused"), ("fp16", "momentum", "fused"),
    ("fp16", "adam", "fused"), ("fp16", "lars", "foreach"), ("fp16-pure", "momentum", "fused"),
    ("fp16-pure", "lamb", "foreach"), ("fp32", "adam", "compiled")])
def test_accelerated_graph_matches_accelerated_eager(precision, optimizer, impl):
    lr = {"momentum": 0.05, "adam": 1e-3, "lars": 1.0, "lamb": 1e-2}[optimizer]
    data = batches(10)
    runs = []
    for graph in (False, True):
        cfg = AccelConfig(precision=precision, optimizer_impl=impl, cuda_graph=graph,
                          channels_last=True, loss_scale_init=2.0 ** 12)
        acc = accelerate(Net(), F.cross_entropy, accuracy, cfg, DEVICE,
                         lambda params, i: make_optimizer(optimizer, params, lr, impl=i))
        if not graph:
            prepare_optimizer_for_graph(acc.optimizer, DEVICE)  # same tensor lr as the graph
        runs.append((acc, _run(acc.step_fn, acc.model, acc.optimizer, data)))
    (a, obs_a), (b, obs_b) = runs
    assert isinstance(b.step_fn, CudaGraphStep) and b.step_fn.replays == 7
    tol = 1e-5 if precision == "fp32" else 2e-3
    _assert_same(a.model, b.model, obs_a, obs_b, atol=tol)
    if precision.startswith("fp16"):
        assert float(obs_b[-1]["main/skipped_steps"]) == float(obs_a[-1]["main/skipped_steps"])
        assert float(obs_b[-1]["main/loss_scale"]) == float(obs_a[-1]["main/loss_scale"])


def test_graph_refuses_what_it_cannot_capture():
    sgd = lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl)  # noqa: E731
    with pytest.raises(ConfigError, match="--optimizer-impl fused"):
        accelerate(Net(), F.cross_entropy, accuracy,
                   AccelConfig(cuda_graph=True, optimizer_impl="foreach"), DEVICE, sgd)
    adam = lambda params, impl: make_optimizer("adam", params, 1e-3, impl=impl)  # noqa: E731
    with pytest.raises(ConfigError, match="skip an overflowing step"):
        accelerate(Net(), F.cross_entropy, accuracy,
                   AccelConfig(precision="fp16", cuda_graph=True, optimizer_impl="foreach"),
                   DEVICE, adam)


def test_trainer_with_graph_schedule_and_log(tmp_path):
    from kasoku.data.base import ArrayDataset
    from kasoku.data.loader import SerialLoader
    from kasoku.train import Trainer
    from kasoku.train.extensions import LinearWarmup, LogReport

    cfg = AccelConfig(precision="fp16", optimizer_impl="fused", cuda_graph=True)
    acc = accelerate(Net(), F.cross_entropy, accuracy, cfg, DEVICE,
                     lambda params, impl: make_optimizer("momentum", params, 0.1, impl=impl))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    loader = SerialLoader(ArrayDataset(x, y), 16, seed=0)  # 7 batches, the last one of 4
    trainer = Trainer(acc.model, acc.optimizer, loader, F.cross_entropy, metric_fn=accuracy,
                      device=DEVICE, stop_trigger=(3, "epoch"), out=tmp_path,
                      step_fn=acc.step_fn)
    for ext in acc.extensions:
        trainer.extend(ext)
    trainer.extend(LinearWarmup(2.0))
    trainer.extend(LogReport(trigger=(1, "epoch")))
    with pytest.warns(LeverWarning, match="run eagerly"):
        trainer.run()
    log = trainer.get_extension("LogReport").log
    assert len(log) == 3 and log[-1]["main/loss"] < log[0]["main/loss"]
    assert log[0]["lr"] < log[1]["lr"] < log[2]["lr"] == pytest.approx(0.1)
    assert log[-1]["main/loss_scale"] > 0 and log[-1]["main/skipped_steps"] >= 0
    assert acc.step_fn.replays > 0


@pytest.mark.slow
def test_full_ladder_config_trains():
    cfg = AccelConfig(precision="bf16", channels_last=True, cudnn_benchmark=True,
                      optimizer_impl="fused", compile=True, cuda_graph=True)
    acc = accelerate(Net(), F.cross_entropy, accuracy, cfg, DEVICE,
                     lambda params, impl: make_optimizer("momentum", params, 0.05, impl=impl))
    assert acc.notes == []
    data = batches(1) * 20
    obs = _run(acc.step_fn, acc.model, acc.optimizer, data)
    assert float(obs[-1]["main/loss"]) < 0.8 * float(obs[0]["main/loss"])
    assert acc.step_fn.replays == 17
