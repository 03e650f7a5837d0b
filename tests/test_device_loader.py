import pytest
import torch

from kasoku.data.base import ArrayDataset
from kasoku.data.cifar10 import AugmentedArrayDataset
from kasoku.data.device_loader import DeviceLoader
from kasoku.data.loader import SerialLoader
from kasoku.data.synthetic import SyntheticDataset
from kasoku.data.transforms import ToUnitFloat

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _images(n=50):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (n,), generator=g))


def _datasets():
    x, t = _images()
    norm = ToUnitFloat((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))
    return [ArrayDataset(x, t, transform=norm, name="plain"),
            AugmentedArrayDataset(x, t, transform=norm, name="augmented", seed=5, pad=2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", [0, 1])
def test_same_batches_as_serial_over_epochs_and_shards(device, which):
    for rank in (0, 1):
        ds = _datasets()[which]
        serial = SerialLoader(ds, 8, seed=3, rank=rank, world_size=2)
        resident = DeviceLoader(ds, 8, device=device, seed=3, rank=rank, world_size=2)
        for _ in range(3 * serial.batches_per_epoch):
            (xs, ts), (xd, td) = next(serial), next(resident)
            assert xd.device.type == device
            assert torch.equal(xs, xd.cpu()) and torch.equal(ts, td.cpu())
        assert resident.epoch == serial.epoch == 3


@pytest.mark.parametrize("device", DEVICES)
def test_resumes_with_the_next_batch(device):
    ds = _datasets()[1]
    a = DeviceLoader(ds, 8, device=device, seed=1)
    for _ in range(9):
        next(a)
    b = DeviceLoader(ds, 8, device=device, seed=1)
    b.load_state_dict(a.state_dict())
    for _ in range(10):
        (xa, ta), (xb, tb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ta, tb)


def test_refuses_datasets_that_are_not_in_memory():
    with pytest.raises(TypeError, match="in-memory"):
        DeviceLoader(SyntheticDataset(10, (3,), num_classes=2), 2, device="cpu")
