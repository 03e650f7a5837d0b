"""Several optimizer steps per call: chunked loaders, MultiStep, the Updater's step count,
and the ``--steps-per-call`` wiring (kasoku.accel.multistep)."""
import io
import json

import pytest
import torch
from torch import nn

from kasoku.accel.compose import accelerate
from kasoku.accel.config import AccelConfig
from kasoku.accel.multistep import MultiStep, short_chunk_advice
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.core.errors import ConfigError
from kasoku.data.base import ArrayDataset
from kasoku.data.cifar10 import AugmentedArrayDataset
from kasoku.data.device_loader import ChunkedLoader, DeviceLoader
from kasoku.data.loader import SerialLoader
from kasoku.data.transforms import ToUnitFloat
from kasoku.train import LogReport, ProgressBar, Trainer
from kasoku.train.step import StandardStep


class CountingDataset(AugmentedArrayDataset):
    """Counts ``get_batch`` calls: a chunk must be one fetch."""
    fetches = 0

    def get_batch(self, indices):
        self.fetches += 1
        return super().get_batch(indices)


def _images(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 3, 6, 6), generator=g, dtype=torch.uint8)
    return CountingDataset(x, torch.randint(0, 10, (n,), generator=g),
                           transform=ToUnitFloat((0.5, 0.4, 0.3), (0.2, 0.2, 0.2)), seed=5, pad=1)


def _loader(kind, dataset, batch_size, k, **kw):
    if kind == "device":
        return DeviceLoader(dataset, batch_size, device="cpu", batches_per_call=k, **kw)
    return ChunkedLoader(dataset, batch_size, batches_per_call=k, **kw)


def _progress(loader):
    return (loader.epoch, loader.position, loader.is_new_epoch, loader.epoch_detail)


@pytest.mark.parametrize("kind", ["serial", "device"])
@pytest.mark.parametrize("n, drop_last, world_size", [(78, False, 1), (78, True, 1),
                                                      (80, False, 1), (77, False, 2)])
def test_chunks_concatenate_to_the_serial_batches(kind, n, drop_last, world_size):
    for k in (1, 3, 4, 64):
        ds = _images(n)
        serial = SerialLoader(ds, 8, seed=3, drop_last=drop_last, rank=world_size - 1,
                              world_size=world_size)
        chunked = _loader(kind, ds, 8, k, seed=3, drop_last=drop_last, rank=world_size - 1,
                          world_size=world_size)
        assert chunked.batches_per_epoch == serial.batches_per_epoch
        while chunked.epoch < 3:
            before, chunk = chunked.dataset.fetches, next(chunked)
            # One gather and one transform per chunk (the device loader holds a copy of ds).
            assert chunked.dataset.fetches == before + 1
            if k == 1:
                chunk = tuple(x.unsqueeze(0) for x in chunk)
            xs, ts = chunk
            assert len(xs) == len(ts) == chunked.last_chunk_batches <= k
            for x, t in zip(xs, ts):
                xe, te = next(serial)
                assert torch.equal(x, xe) and torch.equal(t, te)
            assert _progress(chunked) == _progress(serial)  # counted in batches
        assert serial.epoch == 3 and serial.position == 0


def test_chunk_sizes_at_epoch_ends():
    # 78 samples, batch 8: nine full batches and one of 6; K=4 -> 4, 4, 1, then the short one.
    loader = ChunkedLoader(_images(78), 8, batches_per_call=4, seed=0)
    shapes = [tuple(next(loader)[0].shape[:2]) for _ in range(8)]
    assert shapes == [(4, 8), (4, 8), (1, 8), (1, 6)] * 2
    assert loader.full_batches_per_epoch == 9 and loader.batches_per_epoch == 10
    once = ChunkedLoader(_images(78), 8, batches_per_call=4, repeat=False)
    assert sum(next(once)[0].shape[0] for _ in range(4)) == 10
    with pytest.raises(StopIteration):
        next(once)


@pytest.mark.parametrize("kind", ["serial", "device"])
def test_mid_epoch_resume_continues_with_the_next_batch(kind):
    ds = _images(78)
    serial = SerialLoader(ds, 8, seed=1)
    first = _loader(kind, ds, 8, 4, seed=1)
    for _ in range(5):  # epoch 1, after the first chunk: position 4
        next(first)
    for _ in range(14):
        next(serial)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 4)
    for k in (4, 3, 1):  # a state taken with another K resumes at the same batch
        resumed = _loader(kind, ds, 8, k, seed=1)
        resumed.load_state_dict(state)
        reference = SerialLoader(ds, 8, seed=1)
        reference.load_state_dict(serial.state_dict())
        for _ in range(6):
            chunk = next(resumed)
            chunk = chunk if k > 1 else tuple(x.unsqueeze(0) for x in chunk)
            for x, t in zip(*chunk):
                xe, te = next(reference)
                assert torch.equal(x, xe) and torch.equal(t, te)


def test_loader_refuses_a_bad_chunk_size():
    with pytest.raises(ValueError, match="batches_per_call"):
        ChunkedLoader(_images(10), 2, batches_per_call=0)


def _mlp_and_batches(n_batches, batch_size=16, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))
    x = torch.randn(n_batches, batch_size, 12)
    t = torch.randint(0, 3, (n_batches, batch_size))
    return model, x, t


def _accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def test_multistep_is_bit_identical_to_single_steps():
    step = StandardStep(nn.functional.cross_entropy, _accuracy)
    single, x, t = _mlp_and_batches(12)
    opt = torch.optim.Adam(single.parameters(), lr=1e-2)
    losses = [step(single, (x[i].clone(), t[i].clone()), opt)["main/loss"] for i in range(12)]

    multi, _, _ = _mlp_and_batches(12)
    opt = torch.optim.Adam(multi.parameters(), lr=1e-2)
    multistep, observations = MultiStep(step), []
    for start, k in ((0, 4), (4, 4), (8, 3), (11, 1)):
        observations.append(multistep(multi, (x[start:start + k], t[start:start + k]), opt))
    for a, b in zip(single.parameters(), multi.parameters()):
        assert torch.equal(a, b)
    assert observations[0]["main/loss"].dim() == 0
    assert torch.equal(observations[0]["main/loss"], torch.stack(losses[:4]).mean())
    assert torch.equal(observations[3]["main/loss"], losses[11])


def test_multistep_averages_and_keeps_running_totals():
    counts = iter(range(1, 10))

    def step(model, batch, optimizer):
        n = float(next(counts))
        return {"main/loss": torch.tensor(n), "main/accuracy": None,
                "main/skipped_steps": torch.tensor(10 * n), "count": torch.tensor(2),
                "lr": n}

    obs = MultiStep(step)(None, (torch.zeros(3, 2), torch.zeros(3, 2)), None)
    assert obs["main/loss"].item() == 2.0 and obs["main/accuracy"] is None
    assert obs["main/skipped_steps"].item() == 30.0  # cumulative: the last value
    assert obs["count"].item() == 2.0 and obs["lr"] == 2.0


def _trainer(tmp_path, k, epochs=3, n=78, batch_size=8, stop=None):
    torch.manual_seed(0)
    x = torch.randn(n, 8)
    dataset = ArrayDataset(x, (x[:, 0] + x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = StandardStep(nn.functional.cross_entropy, _accuracy)
    trainer = Trainer(model, optimizer,
                      ChunkedLoader(dataset, batch_size, seed=0, batches_per_call=k),
                      nn.functional.cross_entropy, metric_fn=_accuracy,
                      stop_trigger=stop or (epochs, "epoch"), out=tmp_path / f"k{k}",
                      step_fn=MultiStep(step) if k > 1 else step)
    trainer.extend(LogReport())
    trainer.extend(LogReport(trigger=(5, "iteration"), filename=None), name="every5")
    return trainer


def test_trainer_counts_steps_and_matches_one_step_per_call(tmp_path):
    runs, bars = {}, {}
    for k in (1, 4):
        trainer = _trainer(tmp_path, k)
        bars[k] = io.StringIO()
        trainer.extend(ProgressBar(plain_interval=0.0, out=bars[k]))
        trainer.run()
        runs[k] = trainer
    one, four = runs[1], runs[4]
    # The bar counts steps, and its samples/s count the samples the steps took: the last
    # call is the epoch's short batch of 78 - 9 * 8 = 6 samples, alone.
    last = bars[4].getvalue().splitlines()[-1]
    assert last.startswith("iteration 30/30  epoch 3.00")
    steps_per_s = float(last.split("  ")[2].split()[0])
    samples_per_s = float(last.split("  ")[3].split()[0].replace(",", ""))
    assert samples_per_s == pytest.approx(6 * steps_per_s, rel=0.01, abs=1)
    assert four.updater.samples == one.updater.samples == 3 * 78
    assert four.updater.iteration == one.updater.iteration == 30  # 3 epochs of 10 batches
    for a, b in zip(one.model.parameters(), four.model.parameters()):
        assert torch.equal(a, b)
    log1, log4 = (r.get_extension("LogReport").log for r in (one, four))
    assert [(e["epoch"], e["iteration"]) for e in log4] == \
        [(e["epoch"], e["iteration"]) for e in log1] == [(1, 10), (2, 20), (3, 30)]
    for a, b in zip(log1, log4):
        assert b["main/loss"] == pytest.approx(a["main/loss"], rel=0.2)
    # (5, "iteration") fires on the call that crosses each multiple of 5 (chunks 4,4,1,1).
    every5 = [e["iteration"] for e in four.get_extension("every5").log]
    assert every5 == [8, 10, 18, 20, 28, 30]
    assert [e["iteration"] for e in one.get_extension("every5").log] == [5, 10, 15, 20, 25, 30]


def test_trainer_resumes_mid_epoch_exactly(tmp_path):
    full = _trainer(tmp_path / "full", 4)
    full.run()
    first = _trainer(tmp_path / "first", 4, stop=(14, "iteration"))
    first.run()
    assert first.updater.iteration == 14 and first.train_loader.position == 4
    second = _trainer(tmp_path / "second", 4)
    second.load_state_dict(first.state_dict())
    second.run()
    assert second.updater.iteration == 30
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_accelerate_wraps_the_step_and_checks_the_setting():
    def make_opt(params, impl):
        return torch.optim.Adam(params, lr=1e-3)
    acc = accelerate(nn.Linear(4, 2), nn.functional.cross_entropy, None,
                     AccelConfig(steps_per_call=4), "cpu", make_opt)
    assert isinstance(acc.step_fn, MultiStep)
    acc = accelerate(nn.Linear(4, 2), nn.functional.cross_entropy, None, AccelConfig(), "cpu",
                     make_opt)
    assert not isinstance(acc.step_fn, MultiStep)
    for bad in (0, -2, 2.0):
        with pytest.raises(ConfigError, match="steps_per_call"):
            accelerate(nn.Linear(4, 2), nn.functional.cross_entropy, None,
                       AccelConfig(steps_per_call=bad), "cpu", make_opt)


def test_flag_and_loader_wiring():
    import argparse

    from kasoku.data.registry import create_loader
    parser = argparse.ArgumentParser()
    add_accel_arguments(parser)
    assert accel_config_from_args(parser.parse_args(["--steps-per-call", "8"])) == \
        AccelConfig(steps_per_call=8)
    ds = _images(40)
    assert type(create_loader("serial", ds, 8, torch.device("cpu"))) is SerialLoader
    assert create_loader("serial", ds, 8, torch.device("cpu"), batches_per_call=4) \
        .batches_per_call == 4
    assert create_loader("device", ds, 8, torch.device("cpu"), batches_per_call=4) \
        .batches_per_call == 4
    with pytest.raises(ConfigError, match="--loader serial or --loader device"):
        create_loader("threads", ds, 8, torch.device("cpu"), batches_per_call=4)


def test_short_chunk_advice():
    assert short_chunk_advice(50, 600) is None
    assert short_chunk_advice(1000, 600) is None  # one chunk per epoch, always the same
    advice = short_chunk_advice(64, 600)
    assert "chunk of 24" in advice and "60 or 75" in advice


def test_cli_trains_sine_lstm_with_steps_per_call(tmp_path):
    from kasoku.cli import main
    out = tmp_path / "run"
    code = main(["train", "sine-lstm", "--steps-per-call", "4", "--epochs", "2",
                 "--synthetic-size", "800", "--out", str(out), "--no-progress"])
    assert code == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["iteration"]) for e in log] == [(1, 8), (2, 16)]
    assert log[-1]["main/loss"] < log[0]["main/loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_holds_all_steps_of_a_call():
    import warnings

    from kasoku.accel.graph import CudaGraphStep, prepare_optimizer_for_graph
    from kasoku.accel.notes import LeverWarning, reset_warnings
    from kasoku.optim import make_optimizer
    reset_warnings()
    device = torch.device("cuda")
    _, x, t = _mlp_and_batches(4 * 8 + 2)
    x, t = x.to(device), t.to(device)
    step = StandardStep(nn.functional.cross_entropy, _accuracy)
    twins = []
    for _ in range(2):
        model = _mlp_and_batches(1)[0].to(device)
        opt = make_optimizer("adam", model.parameters(), 1e-2, impl="fused")
        prepare_optimizer_for_graph(opt, device)
        twins.append((model, opt))
    (eager_model, eager_opt), (model, opt) = twins
    graphed = CudaGraphStep(MultiStep(step), device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two "epochs" of 8 chunks of 4 and one of 2
            for i in range(len(x)):
                step(eager_model, (x[i], t[i]), eager_opt)
            for start in range(0, len(x), 4):
                graphed(model, (x[start:start + 4], t[start:start + 4]), opt)
    assert graphed.replays == 2 * 8 - 3 and graphed.eager_steps == 3 + 2
    assert sum(issubclass(w.category, LeverWarning) for w in caught) == 1  # once, not per epoch
    for a, b in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a replay of the K steps never syncs
    try:
        obs = graphed(model, (x[:4], t[:4]), opt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphed.replays == 2 * 8 - 2 and obs["main/loss"].dim() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("steps_per_call, warmup_calls", [(1, 3), (2, 2), (50, 1)])
def test_graph_warm_up_counts_the_steps_of_a_chunk(steps_per_call, warmup_calls):
    from kasoku.accel.graph import apply_cuda_graph
    graphed = apply_cuda_graph(MultiStep(StandardStep(nn.functional.cross_entropy)),
                               torch.device("cuda"), steps_per_call=steps_per_call)
    assert graphed.warmup_steps == warmup_calls
