import pytest
import torch

from kasoku.data.base import ArrayDataset
from kasoku.data.loader import SerialLoader


class IndexDataset:
    """Per-item path only: input = the index as a tensor, target = the index as an int."""

    def __init__(self, n):
        self.n, self.epochs = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def index_array(n):
    return ArrayDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n))


def epoch_targets(loader):
    batches = [next(loader)[1] for _ in range(loader.batches_per_epoch)]
    assert loader.is_new_epoch
    return torch.cat(batches)


@pytest.mark.parametrize("make", [index_array, IndexDataset])
def test_every_epoch_is_a_permutation_and_orders_differ(make):
    loader = SerialLoader(make(103), batch_size=10, seed=3)
    assert len(loader) == loader.batches_per_epoch == 11
    orders = [epoch_targets(loader) for _ in range(3)]
    for order in orders:
        assert order.dtype == torch.int64
        assert torch.equal(order.sort().values, torch.arange(103))
    assert not torch.equal(orders[0], orders[1])
    assert loader.epoch == 3 and loader.position == 0 and loader.epoch_detail == 3.0


def test_both_paths_give_the_same_batches():
    a = SerialLoader(index_array(50), batch_size=7, seed=1)
    b = SerialLoader(IndexDataset(50), batch_size=7, seed=1)
    for _ in range(20):
        (xa, ta), (xb, tb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ta, tb)
        assert xb.shape == (len(tb), 1)


def test_set_epoch_called_when_each_epoch_starts():
    ds = IndexDataset(10)
    loader = SerialLoader(ds, batch_size=4)
    for _ in range(7):  # 3 batches per epoch: epochs 0, 1, 2 start
        next(loader)
    assert ds.epochs == [0, 1, 2]


def test_epoch_detail_and_is_new_epoch():
    loader = SerialLoader(index_array(10), batch_size=4)
    seen = []
    for _ in range(4):
        next(loader)
        seen.append((loader.epoch, loader.position, loader.epoch_detail, loader.is_new_epoch))
    assert seen == [(0, 1, 1 / 3, False), (0, 2, 2 / 3, False), (1, 0, 1.0, True),
                    (1, 1, 4 / 3, False)]


def test_drop_last_and_no_shuffle():
    loader = SerialLoader(index_array(10), batch_size=4, shuffle=False, drop_last=True)
    assert len(loader) == 2
    assert torch.equal(epoch_targets(loader), torch.arange(8))


@pytest.mark.parametrize("n, world_size", [(100, 4), (101, 4), (3, 4)])
def test_shards_cover_the_dataset_with_equal_counts(n, world_size):
    shards = [SerialLoader(index_array(n), batch_size=5, seed=7, rank=r, world_size=world_size)
              for r in range(world_size)]
    for epoch in range(2):
        parts = [torch.cat([next(s)[1] for _ in range(s.batches_per_epoch)]) for s in shards]
        assert len({len(p) for p in parts}) == 1
        assert set(torch.cat(parts).tolist()) == set(range(n))
        if n % world_size == 0:
            assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))


def test_state_round_trip_resumes_with_exactly_the_next_batch():
    for k in [0, 3, 4, 11, 25]:
        ref = SerialLoader(IndexDataset(23), batch_size=4, seed=5)
        for _ in range(k):
            next(ref)
        state = ref.state_dict()
        expected = [next(ref)[1] for _ in range(10)]
        ds = IndexDataset(23)
        fresh = SerialLoader(ds, batch_size=4, seed=999)
        fresh.load_state_dict(state)
        assert fresh.epoch_detail == pytest.approx(k / 6)
        assert all(torch.equal(e, next(fresh)[1]) for e in expected)
        assert ds.epochs[0] == k // 6  # the resumed epoch's augmentation seed is set


def test_refuses_state_of_another_layout():
    state = SerialLoader(index_array(20), batch_size=4).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        SerialLoader(index_array(20), batch_size=5).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        SerialLoader(index_array(21), batch_size=4).load_state_dict(state)


def test_non_repeating_loader_stops_and_resets():
    loader = SerialLoader(index_array(10), batch_size=4, shuffle=False, repeat=False)
    assert [len(t) for _, t in loader] == [4, 4, 2]
    with pytest.raises(StopIteration):
        next(loader)
    loader.reset()
    assert torch.equal(torch.cat([t for _, t in loader]), torch.arange(10))


def test_bad_arguments():
    with pytest.raises(ValueError):
        SerialLoader(index_array(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError):
        SerialLoader(index_array(3), batch_size=0)
    with pytest.raises(ValueError):
        SerialLoader(index_array(3), batch_size=1, rank=2, world_size=2)
