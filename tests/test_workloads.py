"""Every registered workload, swept from the registry so a new entry is covered automatically:
its model builds, its synthetic data has the shapes the model takes, a few optimizer steps
with its recipe's optimizer lower the loss on a fixed batch, and missing real data is a
``DataError`` that says what to do."""
import argparse
import math
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from kasoku.cli.args import synthetic_loader
from kasoku.commands.train import held_synthetic
from kasoku.core.errors import DataError, KasokuWarning
from kasoku.data import synthetic
from kasoku.data.config import DataConfig
from kasoku.data.registry import create_loader
from kasoku.optim import make_optimizer
from kasoku.train.config import TrainConfig
from kasoku.workloads import common, create_workload, list_workloads

WORKLOADS = list_workloads()
TINY = DataConfig(synthetic=True, synthetic_train_size=8, synthetic_val_size=4)

BIG_MODEL_PARAMS = 5_000_000
"""Above this, the fixed-batch test takes at most 8 steps on 4 samples, and fully convolutional
models (adaptive pooling) see a 16x16 center crop: ResNet-152 at 32x32 costs ~1.5 s a step on
2 CPU cores, at 16x16 ~0.4 s."""


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_declares_itself(name):
    wl = create_workload(name)
    assert wl.name == name and wl.description
    r = wl.recipe
    assert r.optimizer in ("sgd", "momentum", "adam", "adamw")
    assert r.schedule in ("none", "step", "cosine")
    assert r.lr > 0 and r.batch_size > 0 and r.epochs > 0 and 0 <= r.warmup_epochs < r.epochs


@pytest.mark.parametrize("name", WORKLOADS)
def test_synthetic_data_fits_model(name):
    torch.manual_seed(0)
    wl = create_workload(name)
    train, val = wl.build_datasets(TINY, seed=0)
    assert (len(train), len(val)) == (8, 4)
    x, t = train.get_batch(torch.arange(2))
    if x.dtype.is_floating_point:
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
    else:  # a language model's token ids
        assert x.dtype == torch.int64 and int(x.min()) >= 0
    x1, t1 = train[1]
    torch.testing.assert_close(x1, x[1])
    assert torch.equal(t1, t[1])
    model = wl.build_model().eval()
    with torch.no_grad():
        out = model(x)
    loss = wl.loss_fn(out, t)
    assert loss.dim() == 0 and torch.isfinite(loss)
    metric = wl.metric_fn(out, t)
    if wl.has_accuracy:  # the classes along the output's last dimension
        assert t.dtype == torch.int64 and out.shape[:-1] == t.shape and out.shape[0] == 2
        assert 0 <= int(t.min()) and int(t.max()) < out.shape[-1]
        assert metric.dim() == 0 and 0 <= metric.item() <= 1
    else:
        assert metric is None and out.shape == t.shape


@pytest.mark.parametrize("name", WORKLOADS)
def test_synthetic_data_is_deterministic_and_split(name):
    wl = create_workload(name)
    train_a, val_a = wl.build_datasets(TINY, seed=0)
    train_b, _ = wl.build_datasets(TINY, seed=0)
    idx = torch.arange(4)
    xa, ta = train_a.get_batch(idx)
    xb, tb = train_b.get_batch(idx)
    assert torch.equal(xa, xb) and torch.equal(ta, tb)
    assert not torch.equal(xa, val_a.get_batch(idx)[0])   # val is not a copy of train


def _fixed_batch(wl, model):
    data = DataConfig(synthetic=True, synthetic_train_size=16, synthetic_val_size=1)
    train, _ = wl.build_datasets(data, seed=0)
    big = n_params(model) > BIG_MODEL_PARAMS
    x, t = train.get_batch(torch.arange(4 if big else 16))
    pools = any(isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d))
                for m in model.modules())
    if big and pools and x.dim() == 4 and x.shape[-1] > 16:
        top, left = (x.shape[-2] - 16) // 2, (x.shape[-1] - 16) // 2
        x = x[..., top:top + 16, left:left + 16].contiguous()
    if wl.has_accuracy and t.dim() == 1:
        # Distinct labels to memorize: a few synthetic labels may all be one class, which a
        # bias alone fits, and then the test would not show that the network learns.
        with torch.no_grad():
            num_classes = model.eval()(x[:1]).shape[-1]
        model.train()
        t = torch.randperm(len(t), generator=torch.Generator().manual_seed(0)) % num_classes
    return x, t, big


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", WORKLOADS)
def test_recipe_optimizer_lowers_loss_on_fixed_batch(name):
    torch.manual_seed(0)
    wl = create_workload(name)
    model = wl.build_model().train()
    x, t, big = _fixed_batch(wl, model)
    r = wl.recipe
    # The recipe's optimizer, at most 0.05: large-batch lrs (0.8) assume warmup and batch 2048.
    opt = make_optimizer(r.optimizer, model.parameters(), min(r.lr, 0.05),
                         momentum=r.momentum, weight_decay=r.weight_decay)
    # Small models get up to 300 steps (under a second): the sigmoid LeNet5 sits on a plateau
    # near chance for ~100 steps at Adam 1e-3 before it starts to memorize. They run on one
    # thread: their ops are tiny, and on a busy 2-core machine OpenMP's spinning barriers made
    # LeNet5's 130 steps take 24 s on two threads against 0.5 s on one.
    max_steps = 8 if big else 300
    target, losses = None, []
    with _threads(torch.get_num_threads() if big else 1):
        for _ in range(max_steps):
            loss = wl.loss_fn(model(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            target = 0.7 * losses[0]
            if losses[-1] < target:
                break
    assert losses[-1] < target, (f"{name}: loss {losses[0]:.4g} -> {losses[-1]:.4g} in "
                                 f"{len(losses)} steps, wanted < {target:.4g}")


@pytest.mark.parametrize("name", WORKLOADS)
def test_missing_real_data_says_what_to_do(name):
    wl = create_workload(name)
    if getattr(wl, "generated_data", False) or wl.default_data:
        # Generated, or on every machine (gpt: the standard library's sources; tokenized
        # into the session's cache, conftest's KASOKU_CACHE).
        train, val = wl.build_datasets(DataConfig(), seed=0)   # needs no --data
        assert len(train) > 0 and len(val) > 0
        return
    with pytest.raises(DataError) as err:
        wl.build_datasets(DataConfig(root=None), seed=0)
    message = str(err.value)
    assert "--data DIR" in message and "--synthetic" in message and name in message


def test_missing_data_messages_name_the_way_to_get_it():
    def message(name):
        with pytest.raises(DataError) as err:
            create_workload(name).build_datasets(DataConfig(), seed=0)
        return str(err.value)
    assert "kasoku data download mnist --out DIR" in message("mnist-mlp")
    assert "kasoku data download cifar10 --out DIR" in message("cifar10-lenet5")
    assert "kasoku data download cifar10 --out DIR" in message("cifar10-resnet152")
    imagenet = message("imagenet-resnet50")
    assert "cannot be downloaded" in imagenet and "kasoku data make-jpeg" in imagenet


SYNTHETIC_64 = DataConfig(synthetic=True, synthetic_train_size=64, synthetic_val_size=1)


def _same_kind(real, synthetic):
    """Real and synthetic batches reach the model with the same shape, dtype and scale."""
    xr, tr = real.get_batch(torch.arange(64))
    xs, ts = synthetic.get_batch(torch.arange(64))
    assert xr.shape[1:] == xs.shape[1:] and xr.dtype == xs.dtype and tr.dtype == ts.dtype
    assert abs(xr.min().item() - xs.min().item()) < 0.5
    assert abs(xr.max().item() - xs.max().item()) < 0.5


def test_mnist_mlp_real_data(mnist_dir):
    wl = create_workload("mnist-mlp")
    train, val = wl.build_datasets(DataConfig(root=mnist_dir))
    assert (len(train), len(val)) == (60000, 10000)
    _same_kind(train, wl.build_datasets(SYNTHETIC_64)[0])


@pytest.mark.parametrize("name", ["cifar10-lenet5", "cifar10-resnet18", "cifar10-resnet152"])
def test_cifar10_real_data_holdout(name, cifar10_dir):
    wl = create_workload(name)
    train, val = wl.build_datasets(DataConfig(root=cifar10_dir))
    assert (len(train), len(val)) == (40000, 10000)   # batches 1-4 / batch 5
    assert wl.epoch_samples == len(train)   # what kasoku compare extrapolates an epoch to
    _same_kind(train, wl.build_datasets(SYNTHETIC_64)[0])


def test_imagenet_resnet50_reads_an_image_folder(tmp_path):
    from PIL import Image
    for c, cls in enumerate(["cat", "dog"]):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (64, 48), (80 * c, 40 * i, 200)).save(tmp_path / cls / f"{i}.jpg")
    wl = create_workload("imagenet-resnet50")
    train, val = wl.build_datasets(DataConfig(root=tmp_path))
    assert len(train) == 4 and val is None   # no val/ folder
    x, t = train[3]
    xs, ts = wl.build_datasets(TINY)[0][0]
    assert x.shape == xs.shape == (3, 224, 224) and x.dtype == xs.dtype and int(t) == 1


def test_sine_data():
    from kasoku.data.sine import STEP_RAD, sine_datasets
    train, val = sine_datasets(n_train=32, n_val=8, seq_len=50, seed=3)
    x, t = train.get_batch(torch.arange(32))
    assert x.shape == t.shape == (32, 50, 1)
    torch.testing.assert_close(x[:, 1:], t[:, :-1])   # target is the next input
    # a sine at STEP_RAD per step obeys x[k+1] + x[k-1] = 2 cos(STEP_RAD) x[k]
    torch.testing.assert_close(x[:, 2:] + x[:, :-2], 2 * math.cos(STEP_RAD) * x[:, 1:-1],
                               atol=1e-5, rtol=0)
    assert torch.equal(x, sine_datasets(32, 8, seed=3)[0].get_batch(torch.arange(32))[0])
    assert not torch.equal(val.get_batch(torch.arange(8))[0], x[:8])
    assert not torch.equal(x, sine_datasets(32, 8, seed=4)[0].get_batch(torch.arange(32))[0])


def test_synthetic_images_drawn_on_demand_can_be_held_and_give_the_same_batches(monkeypatch):
    """A synthetic set too large to be drawn whole at start (ImageNet's 2,816 images) is held
    as tensors for the device loader: the same samples and labels for the same indices, and
    the device loader's batches are the serial loader's."""
    monkeypatch.setattr(synthetic, "MATERIALIZE_BYTES", 0)  # everything drawn on demand
    data = DataConfig(synthetic=True, synthetic_train_size=24, synthetic_val_size=8)
    train, val = create_workload("cifar10-lenet5").build_datasets(data, seed=3)
    assert train.base._inputs is None and train.held_in_memory
    held = train.in_memory()
    idx = torch.tensor([5, 0, 23, 7])
    for a, b in zip(held.get_batch(idx), train.get_batch(idx)):
        assert torch.equal(a, b)
    serial = create_loader("serial", train, 8, "cpu", seed=1)
    device = create_loader("device", train, 8, "cpu", seed=1)
    for _ in range(4):  # past an epoch's end
        for a, b in zip(next(serial), next(device)):
            assert torch.equal(a, b)
    # on a GPU, --synthetic without --loader takes the device loader; a loader given stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(loader=None, device="auto")
    assert synthetic_loader(args, data) == {"loader": "device"}
    assert synthetic_loader(argparse.Namespace(loader="serial", device="auto"), data) == {}
    assert synthetic_loader(argparse.Namespace(loader=None, device="cpu"), data) == {}
    assert synthetic_loader(argparse.Namespace(loader=None, device="auto", procs=2), data) == {}
    assert synthetic_loader(args, DataConfig()) == {}
    # too many samples to hold: the serial loader draws them on the host, said once
    monkeypatch.setattr(common, "RESIDENT_BYTES", train.nbytes - 1)
    asked = TrainConfig(loader="device")
    with pytest.warns(KasokuWarning, match="too many to hold on the device"):
        assert held_synthetic(asked, data, train, val).loader == "serial"
    monkeypatch.setattr(common, "RESIDENT_BYTES", train.nbytes)
    assert held_synthetic(asked, data, train, val) is asked
