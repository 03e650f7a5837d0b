"""DevicePrefetcher: the same batches as its inner loader, one pulled ahead, and a loader state
(epoch, position, resume) that is the consumer's, not the inner loader's."""
import contextlib

import pytest
import torch
from torch import nn

from kasoku.data.base import ArrayDataset
from kasoku.data.device_loader import ChunkedLoader, DeviceLoader
from kasoku.data.loader import SerialLoader
from kasoku.data.parallel_loader import ThreadLoader
from kasoku.data.prefetch import DevicePrefetcher, wrap_for_device
from kasoku.train import Snapshot, Trainer
from kasoku.train.triggers import ManualScheduleTrigger

CPU = torch.device("cpu")
SEEN = ("epoch", "position", "is_new_epoch", "epoch_detail")


def array_set(n=13):
    return ArrayDataset(torch.arange(n, dtype=torch.float32)[:, None] * 10, torch.arange(n))


def serial(**kw):
    return SerialLoader(array_set(), 4, seed=7, **kw)  # 4 batches per epoch, the last of 1


def threads(**kw):
    return ThreadLoader(array_set(), 4, seed=7, num_threads=2, **kw)


def assert_same_batch(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)


@contextlib.contextmanager
def closing(*loaders):
    try:
        yield loaders
    finally:
        for loader in loaders:
            getattr(loader, "close", lambda: None)()


def seen(loader):
    return {name: getattr(loader, name) for name in SEEN} | {"state": loader.state_dict()}


@pytest.mark.parametrize("make", [serial, threads])
def test_same_batches_and_the_bare_loaders_state_after_every_batch(make):
    bare, wrapped = make(), DevicePrefetcher(make(), CPU)
    with closing(bare, wrapped):
        assert seen(wrapped) == seen(bare)  # nothing handed out yet: the loader's own
        for _ in range(3 * bare.batches_per_epoch):
            assert_same_batch(next(bare), next(wrapped))
            assert seen(wrapped) == seen(bare)
        assert wrapped.epoch == 3 and wrapped.is_new_epoch
        assert wrapped.loader.position == 1  # the inner loader is one batch ahead
        assert [len(next(wrapped)[0]) for _ in range(4)] == [4, 4, 4, 1]


@pytest.mark.parametrize("make", [serial, threads])
@pytest.mark.parametrize("cut", [1, 3, 4, 6])
def test_mid_epoch_state_resumes_wrapped_and_bare_loaders_exactly(make, cut):
    with closing(make()) as (reference,):
        expected = [next(reference) for _ in range(cut + 6)]
    with DevicePrefetcher(make(), CPU) as first:
        for batch in expected[:cut]:
            assert_same_batch(batch, next(first))
        state = first.state_dict()
        next(first)  # goes on, with another batch pulled ahead
    with closing(DevicePrefetcher(make(), CPU), make()) as (fresh, bare):
        next(fresh)  # a batch pulled ahead that the resume must drop
        fresh.load_state_dict(state)
        bare.load_state_dict(state)
        assert seen(fresh) == seen(bare)
        for batch in expected[cut:]:
            assert_same_batch(batch, next(fresh))
            assert_same_batch(batch, next(bare))
            assert seen(fresh) == seen(bare)


@pytest.mark.parametrize("make", [serial, threads])
def test_repeat_false_ends_like_the_bare_loader_and_reset_rewinds(make):
    bare, wrapped = make(repeat=False, shuffle=False), \
        DevicePrefetcher(make(repeat=False, shuffle=False), CPU)
    with closing(bare, wrapped):
        for _ in range(2):
            expected = list(bare)
            got = list(wrapped)
            assert [len(b[1]) for b in got] == [4, 4, 4, 1]
            for a, b in zip(expected, got):
                assert_same_batch(a, b)
            with pytest.raises(StopIteration):
                next(wrapped)
            assert seen(wrapped) == seen(bare)
            bare.reset()
            wrapped.reset()
        next(wrapped)
        wrapped.reset()  # mid-pass: the batch pulled ahead is dropped
        assert seen(wrapped) == seen(bare) and len(list(wrapped)) == 4


def test_chunks_report_the_handed_out_chunks_size():
    bare = ChunkedLoader(array_set(), 4, batches_per_call=3, seed=1)
    wrapped = DevicePrefetcher(ChunkedLoader(array_set(), 4, batches_per_call=3, seed=1), CPU)
    assert wrapped.last_chunk_batches == 0 and wrapped.full_batches_per_epoch == 3
    for _ in range(4):
        assert_same_batch(next(bare), next(wrapped))
        assert wrapped.last_chunk_batches == bare.last_chunk_batches  # 3, then the lone 1
        assert seen(wrapped) == seen(bare)


class FailingAt(ArrayDataset):
    def __init__(self, bad_index):
        super().__init__(torch.arange(8.0)[:, None], torch.arange(8))
        self.bad_index, self.armed = bad_index, True

    def get_batch(self, indices):
        if self.armed and self.bad_index in indices.tolist():
            raise ValueError("bad batch")
        return super().get_batch(indices)


def test_an_error_pulling_ahead_comes_when_its_batch_is_due():
    dataset = FailingAt(5)
    wrapped = DevicePrefetcher(SerialLoader(dataset, 2, shuffle=False), CPU)
    assert_same_batch(next(wrapped), (torch.tensor([[0.0], [1.0]]), torch.tensor([0, 1])))
    assert_same_batch(next(wrapped), (torch.tensor([[2.0], [3.0]]), torch.tensor([2, 3])))
    with pytest.raises(ValueError, match="bad batch"):
        next(wrapped)
    assert wrapped.position == 2  # where the bare loader stands after the same failure
    dataset.armed = False
    assert next(wrapped)[1].tolist() == [4, 5]  # retried, as the bare loader would


def test_other_attributes_are_the_inner_loaders():
    inner = serial()
    wrapped = DevicePrefetcher(inner, CPU)
    assert len(wrapped) == 4 and wrapped.batches_per_epoch == 4
    assert wrapped.dataset is inner.dataset and wrapped.batch_size == 4
    assert wrapped.skipped == 0 and wrapped.skipped_files == []
    assert wrapped.last_chunk_batches == inner.last_chunk_batches == 1  # one batch a call
    assert not hasattr(wrapped, "__getitem__")  # the Evaluator must not take it for a dataset
    with pytest.raises(AttributeError):
        wrapped.no_such_thing
    with threads() as inner_threads:
        closing = DevicePrefetcher(inner_threads, CPU)
        next(closing)
        closing.close()
        assert inner_threads._pool._shutdown


def test_wrap_for_device_leaves_cpu_and_device_resident_loaders_alone():
    loader = serial()
    assert wrap_for_device(loader, CPU) is loader
    on_device = DeviceLoader(array_set(), 4, device="cpu")
    assert wrap_for_device(on_device, torch.device("cuda")) is on_device

    class GpuDecoding:
        yields_device_batches = True

    gpu = GpuDecoding()
    assert wrap_for_device(gpu, torch.device("cuda")) is gpu


def build(out, loader, stop, snapshot_trigger=None, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 13))
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), loader,
                      nn.functional.cross_entropy, device=device,
                      stop_trigger=(stop, "iteration"), out=out)
    trainer.extend(Snapshot(), trigger=snapshot_trigger or (100, "iteration"))
    return trainer


def assert_same_weights(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@pytest.mark.parametrize("cut", [3, 4, 6])
def test_trainer_with_a_wrapped_loader_trains_and_resumes_exactly(tmp_path, cut):
    bare = build(tmp_path / "bare", serial(), 10)
    bare.run()
    first = build(tmp_path, DevicePrefetcher(serial(), CPU), cut + 2,
                  ManualScheduleTrigger(cut, "iteration"))
    first.run()
    resumed = build(tmp_path, DevicePrefetcher(serial(), CPU), 10)
    resumed.run(resume=tmp_path / "snapshot_latest.pt")
    assert resumed.updater.iteration == 10
    assert resumed.updater.epoch_detail == bare.updater.epoch_detail == 2.5
    assert_same_weights(bare, resumed)


def test_build_trainer_wiring_with_the_prefetcher(tmp_path, monkeypatch):
    """What --device cuda does, on the CPU: the train and val loaders wrapped, the run and a
    resume giving the bare loaders' weights, the train loader closed at the end."""
    from kasoku.commands.train import train_run
    from kasoku.data.config import DataConfig
    from kasoku.run import resolve
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload

    wrapped = []

    def always_wrap(loader, device):
        wrapped.append(DevicePrefetcher(loader, device))
        return wrapped[-1]

    data = DataConfig(synthetic=True, synthetic_train_size=120, synthetic_val_size=40)

    def run(out, epochs, resume=None, loader="serial"):
        run = resolve(create_workload("sine-lstm"), data,
                      TrainConfig(epochs=epochs, batch_size=50, out=out, progress=False,
                                  loader=loader))
        run.check()
        return train_run(run, resume=resume)

    straight = run(tmp_path / "straight", 2)
    import kasoku.commands.train
    monkeypatch.setattr(kasoku.commands.train, "wrap_for_device", always_wrap)
    run(tmp_path / "split", 1, loader="threads:2")
    split = run(tmp_path / "split", 2, resume=tmp_path / "split" / "snapshot_latest.pt",
                loader="threads:2")
    assert split.train_loader is wrapped[2] and len(wrapped) == 4  # train and val, twice
    assert wrapped[2].loader._pool._shutdown  # train_run closed it through the wrapper
    for val in (wrapped[1], wrapped[3]):
        val.close()
    assert split.get_extension("Evaluator").loader is wrapped[3]
    assert_same_weights(straight, split)
    assert [e["validation/main/loss"] for e in straight.get_extension("LogReport").log] == \
        [e["validation/main/loss"] for e in split.get_extension("LogReport").log]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [serial, threads])
def test_cuda_batches_arrive_on_the_device_and_resume_exactly(make, tmp_path):
    cuda = torch.device("cuda")
    with closing(make()) as (reference,):
        expected = [next(reference) for _ in range(10)]
    wrapped = wrap_for_device(make(), cuda)
    assert isinstance(wrapped, DevicePrefetcher)
    with wrapped:
        for batch in expected[:3]:
            got = next(wrapped)
            assert all(x.is_cuda for x in got)
            assert_same_batch(batch, tuple(x.cpu() for x in got))
        state = wrapped.state_dict()
    with wrap_for_device(make(), cuda) as fresh:
        next(fresh)
        fresh.load_state_dict(state)
        for batch in expected[3:]:
            got = next(fresh)
            # Used on the consumer's stream right away, as a step would.
            assert_same_batch(batch, tuple((x * 1).cpu() for x in got))

    bare = build(tmp_path / "bare", serial(), 10, device=cuda)
    bare.run()
    with wrap_for_device(make(), cuda) as loader:
        build(tmp_path, loader, 6, ManualScheduleTrigger(5, "iteration"), device=cuda).run()
    with wrap_for_device(make(), cuda) as loader:
        resumed = build(tmp_path, loader, 10, device=cuda)
        resumed.run(resume=tmp_path / "snapshot_latest.pt")
    assert_same_weights(bare, resumed)
