"""The loader registry, swept: every registered kind yields SerialLoader's samples in
SerialLoader's order (exactly for decoded tensors; for JPEG folders decoded elsewhere the same
labels and the same crops, as test_gpu_jpeg measures) and resumes from its state, on the CPU in
real threads and worker processes. A kind added to the registry is covered here at once."""
import pytest
import torch

from kasoku.core.errors import ConfigError
from kasoku.data.base import ArrayDataset
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_synth import make_jpeg_folder
from kasoku.data.loader import SerialLoader
from kasoku.data.registry import (
    accepts,
    create_loader,
    list_loaders,
    loader_kind,
    parse_loader_spec,
    register_loader,
    spec_forms,
)
from kasoku.data.transforms import ToUnitFloat

BATCH, IMAGE = 4, 16


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry") / "images"
    make_jpeg_folder(root, 12, 40, 30, num_classes=3, progress=False, workers=1)
    return root


def arrays():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (22, 1, 6, 6), generator=g, dtype=torch.uint8)
    # A picklable transform: worker processes started by spawn or forkserver (as they are
    # once CUDA runs in this process) receive the dataset pickled.
    return ArrayDataset(x, torch.arange(22) % 5, transform=ToUnitFloat())


def dataset_for(name, jpeg_folder):
    if loader_kind(name).needs == "image-folder":
        return ImageFolder(jpeg_folder, train=True, image_size=IMAGE, seed=1)
    return arrays()


def spec_of(name):
    return f"{name}:2" if loader_kind(name).count else name


def take(loader, n):
    return [tuple(t.cpu() for t in next(loader)) for _ in range(n)]


def assert_same(expected, got, exact):
    assert len(expected) == len(got)
    for (xa, ya), (xb, yb) in zip(expected, got):
        assert torch.equal(ya, yb)
        if exact:
            assert torch.equal(xa, xb)
        else:  # decoded on another path: the same crop of the same image, up to resampling
            assert xa.shape == xb.shape and (xa - xb).abs().mean() < 0.2


@pytest.mark.parametrize("name", list_loaders())
def test_every_loader_yields_the_serial_samples_and_resumes(name, jpeg_folder):
    dataset = dataset_for(name, jpeg_folder)
    exact = loader_kind(name).needs != "image-folder"
    steps = 2 * SerialLoader(dataset, BATCH).batches_per_epoch + 1  # across two epochs
    expected = take(SerialLoader(dataset_for(name, jpeg_folder), BATCH, seed=3), steps)
    loader = create_loader(spec_of(name), dataset, BATCH, "cpu", seed=3)
    try:
        first = take(loader, 3)
        state = loader.state_dict()
        rest = take(loader, steps - 3)
    finally:
        getattr(loader, "close", lambda: None)()
    assert_same(expected, first + rest, exact)
    resumed = create_loader(spec_of(name), dataset_for(name, jpeg_folder), BATCH, "cpu", seed=3)
    try:
        resumed.load_state_dict(state)
        assert_same(rest, take(resumed, steps - 3), exact)
    finally:
        getattr(resumed, "close", lambda: None)()


@pytest.mark.parametrize("name", list_loaders())
def test_every_loader_refuses_what_it_cannot_take(name, jpeg_folder):
    kind = loader_kind(name)
    other = arrays() if kind.needs == "image-folder" else \
        ImageFolder(jpeg_folder, train=True, image_size=IMAGE) if kind.needs else None
    if other is not None:
        assert not accepts(kind, other)
        with pytest.raises(ConfigError, match=f"the {name} loader reads"):
            create_loader(name, other, BATCH, "cpu")
    dataset = dataset_for(name, jpeg_folder)
    if not kind.prefetching:
        with pytest.raises(ConfigError, match="keeps none in flight"):
            create_loader(name, dataset, BATCH, "cpu", prefetch=2)
    if not kind.chunks:
        with pytest.raises(ConfigError, match="several batches per call"):
            create_loader(spec_of(name), dataset, BATCH, "cpu", batches_per_call=2)
    with pytest.raises(ConfigError, match="whole number >= 1" if kind.count else "takes no :N"):
        create_loader(f"{name}:0", dataset, BATCH, "cpu")
    with pytest.raises(ConfigError):
        create_loader(name, dataset, 0, "cpu")  # the loader's own check, said the same way


def test_specs_are_parsed_and_listed():
    kind, count = parse_loader_spec("threads:8")
    assert (kind.name, count) == ("threads", 8)
    assert parse_loader_spec("serial") == (loader_kind("serial"), None)
    for bad, message in (("serial:2", "takes no :N"), ("procs", "unknown loader"),
                         ("threads:x", "whole number")):
        with pytest.raises(ConfigError, match=message):
            parse_loader_spec(bad)
    assert spec_forms().endswith("or gpu-jpeg-procs[:N]")


def test_a_loader_of_ones_own_joins_the_registry():
    calls = []

    @register_loader("test-echo", "SerialLoader, counting its builds")
    def _echo(dataset, batch_size, device, count, **kwargs):
        calls.append(count)
        return SerialLoader(dataset, batch_size, **kwargs)

    try:
        assert "test-echo" in list_loaders()
        loader = create_loader("test-echo", arrays(), BATCH, seed=3)
        assert calls == [None] and torch.equal(next(loader)[1],
                                               next(SerialLoader(arrays(), BATCH, seed=3))[1])
        with pytest.raises(ValueError, match="registered twice"):
            register_loader("test-echo", "again")(_echo)
    finally:
        from kasoku.data import registry
        del registry._REGISTRY["test-echo"]
