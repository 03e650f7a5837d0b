import pytest
import torch

from kasoku.data import synthetic
from kasoku.data.synthetic import SyntheticDataset


@pytest.mark.parametrize("materialize", [True, False])
def test_same_samples_in_every_instance_and_batch_composition(monkeypatch, materialize):
    if not materialize:
        monkeypatch.setattr(synthetic, "MATERIALIZE_BYTES", 0)
    a = SyntheticDataset(50, (3, 8, 8), num_classes=10, dtype=torch.uint8, seed=3)
    b = SyntheticDataset(50, (3, 8, 8), num_classes=10, dtype=torch.uint8, seed=3)
    assert (a._inputs is not None) == materialize
    xa, ta = a.get_batch(torch.tensor([7, 1, 30]))
    xb, tb = b.get_batch(torch.tensor([30, 7]))
    assert torch.equal(xa[0], xb[1]) and torch.equal(xa[2], xb[0])
    assert torch.equal(ta[[0, 2]], tb[[1, 0]])
    x1, t1 = a[1]
    assert torch.equal(x1, xa[1]) and int(t1) == int(ta[1])
    other = SyntheticDataset(50, (3, 8, 8), num_classes=10, dtype=torch.uint8, seed=4)
    assert not torch.equal(other.get_batch(torch.tensor([7]))[0], xa[:1])


def test_labels_are_balanced_and_follow_the_input():
    ds = SyntheticDataset(4000, (3, 32, 32), num_classes=10, dtype=torch.uint8)
    x, t = ds.get_batch(torch.arange(4000))
    counts = torch.bincount(t, minlength=10)
    assert counts.min() > 4000 / 10 * 0.5, counts
    # The label is a function of the input: identical inputs get identical labels.
    assert torch.equal(ds._label(x[:100]), t[:100])


def test_regression_targets_and_errors():
    ds = SyntheticDataset(20, (50, 1), target_shape=(50, 1))
    x, t = ds.get_batch(torch.arange(5))
    assert x.dtype == torch.float32 and t.shape == (5, 50, 1) and t.abs().max() <= 1
    with pytest.raises(IndexError):
        ds.get_batch(torch.tensor([20]))
    with pytest.raises(ValueError, match="exactly one"):
        SyntheticDataset(5, (2,))
    with pytest.raises(ValueError, match="at least one"):
        SyntheticDataset(0, (2,), num_classes=2)
