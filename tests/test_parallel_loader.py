import os
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from kasoku.core.errors import DataError
from kasoku.data.base import ArrayDataset
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.loader import SerialLoader
from kasoku.data.parallel_loader import ProcessLoader, ThreadLoader

LOADERS = {
    "threads": lambda ds, bs, **kw: ThreadLoader(ds, bs, num_threads=2, **kw),
    "processes": lambda ds, bs, **kw: ProcessLoader(ds, bs, num_workers=2, **kw),
}


def write_folder(root, per_class=4, classes=3):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"img_{i}.jpg")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("jpegs"))


def array_set(n=13):
    return ArrayDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n))


def batches(loader, count):
    return [next(loader) for _ in range(count)]


def assert_same(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x, y)


def make_dataset(kind, folder):
    return ImageFolder(folder, train=True, image_size=8, seed=1) if kind == "folder" \
        else array_set()


@pytest.mark.parametrize("kind", ["folder", "array"])
@pytest.mark.parametrize("name", list(LOADERS))
def test_same_batches_as_serial_over_two_epochs_and_two_ranks(name, kind, folder):
    for rank in (0, 1):
        kw = dict(shuffle=True, seed=5, rank=rank, world_size=2)
        serial = SerialLoader(make_dataset(kind, folder), 4, **kw)
        with LOADERS[name](make_dataset(kind, folder), 4, **kw) as loader:
            assert len(loader) == len(serial)
            count = 2 * serial.batches_per_epoch
            assert_same(batches(serial, count), batches(loader, count))
            assert loader.epoch == 2 and loader.skipped == 0


@pytest.mark.parametrize("name", list(LOADERS))
def test_exact_mid_epoch_resume_discards_work_in_flight(name, folder):
    serial = SerialLoader(ImageFolder(folder, train=True, image_size=8), 3, seed=2)
    expected = batches(serial, 7)
    with LOADERS[name](ImageFolder(folder, train=True, image_size=8), 3, seed=2) as first:
        assert_same(expected[:2], batches(first, 2))
        state = first.state_dict()
        batches(first, 3)  # moves on, with more batches in flight
        first.load_state_dict(state)
        assert_same(expected[2:], batches(first, 5))
    with LOADERS[name](ImageFolder(folder, train=True, image_size=8), 3, seed=0) as fresh:
        next(fresh)
        fresh.load_state_dict(state)
        assert_same(expected[2:], batches(fresh, 5))


def test_repeat_false_stops_after_one_pass(folder):
    with ThreadLoader(array_set(), 5, shuffle=False, repeat=False) as loader:
        assert [len(b[1]) for b in loader] == [5, 5, 3]


@pytest.fixture
def bad_folder(tmp_path):
    root = write_folder(tmp_path / "bad")
    (root / "class_1" / "img_1.jpg").write_bytes(b"this is not a jpeg")
    (root / "class_2" / "img_0.jpg").write_bytes(b"")
    return root


BAD = ("img_1.jpg", "img_0.jpg")


@pytest.mark.parametrize("name", ["serial", *LOADERS])
def test_bad_files_are_skipped_warned_once_and_counted(name, bad_folder):
    make = (lambda ds, bs, **kw: SerialLoader(ds, bs, **kw)) if name == "serial" \
        else LOADERS[name]
    dataset = ImageFolder(bad_folder, train=True, image_size=8)
    loader = make(dataset, 4, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(loader, 2 * loader.batches_per_epoch)
    assert all(len(b[0]) == 4 for b in got)  # replaced, so batches stay full
    messages = [str(w.message) for w in caught if "img_" in str(w.message)]
    # One warning, for the first bad file met; every one is counted (reported per epoch).
    assert len(messages) == 1 and "counted" in messages[0]
    assert sum(path in messages[0] for path in ("class_1/img_1.jpg", "class_2/img_0.jpg")) == 1
    assert loader.skipped == 2
    assert sorted(os.path.basename(p) for p in loader.skipped_files) == sorted(BAD)
    if name != "serial":
        loader.close()
    # The replacement is deterministic: the same batches as the serial loader's.
    serial = SerialLoader(ImageFolder(bad_folder, train=True, image_size=8), 4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(batches(serial, len(got)), got)


@pytest.mark.parametrize("name", list(LOADERS))
def test_strict_raises_data_error_naming_the_file(name, bad_folder):
    dataset = ImageFolder(bad_folder, train=True, image_size=8, strict=True)
    with LOADERS[name](dataset, 12, shuffle=False) as loader:
        with pytest.raises(DataError, match="class_1/img_1.jpg"):
            next(loader)


def assert_killing_worker_1_is_reported(loader):
    """Kill worker 1 of a started ProcessLoader: the next wait for a batch it never made raises
    an error naming it (and a file), within seconds, instead of hanging."""
    try:
        next(loader)  # workers up and serving
        victim = loader._workers[1][0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=5)
        # Batches the dead worker already sent may still arrive; the first it never made fails.
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker 1 \(pid {victim.pid}\).*img_"):
            for _ in range(loader.batches_per_epoch):
                next(loader)
        assert time.monotonic() - start < 5
    finally:
        loader.close()
    assert not victim.is_alive()


def test_killed_worker_raises_naming_it_instead_of_hanging(folder):
    assert_killing_worker_1_is_reported(
        ProcessLoader(ImageFolder(folder, train=True, image_size=8), 2, num_workers=2,
                      shuffle=False))


def test_close_stops_the_workers():
    loader = ProcessLoader(array_set(), 4, num_workers=2)
    next(loader)
    processes = [w[0] for w in loader._workers]
    loader.close()
    assert not any(p.is_alive() for p in processes)


def test_make_loader_parses_counts():
    from kasoku.core.errors import ConfigError
    from kasoku.data.registry import create_loader
    cpu = torch.device("cpu")
    with create_loader("threads:3", array_set(), 4, cpu) as loader:
        assert isinstance(loader, ThreadLoader) and loader.num_threads == 3
    with create_loader("multiprocess:1", array_set(), 4, cpu) as loader:
        assert isinstance(loader, ProcessLoader) and loader.num_workers == 1
    for bad in ("threads:0", "serial:2", "gpu"):
        with pytest.raises(ConfigError):
            create_loader(bad, array_set(), 4, cpu)


def test_prefetch_sets_the_batches_in_flight():
    from kasoku.core.errors import ConfigError
    from kasoku.data.registry import create_loader
    cpu, data = torch.device("cpu"), array_set(40)  # 20 batches of 2
    expected = batches(SerialLoader(data, 2, seed=0), 10)
    with create_loader("multiprocess:2", data, 2, cpu, prefetch=3) as loader:
        assert loader.prefetch_batches == 3
        got = [next(loader)]
        assert len(loader._pending) == 2 * 3 - 1  # per worker: 6 started, one handed out
        assert_same(expected, got + batches(loader, 9))
    with create_loader("threads:2", data, 2, cpu, prefetch=5) as loader:
        next(loader)
        assert len(loader._pending) == 5 - 1
    with create_loader("multiprocess:1", data, 2, cpu) as loader:
        assert loader.prefetch_batches == 2  # the default
    for kind in ("serial", "device"):
        with pytest.raises(ConfigError, match="keeps none in flight"):
            create_loader(kind, data, 2, cpu, prefetch=2)
    with pytest.raises(ConfigError, match="whole number >= 1"):
        create_loader("threads:2", data, 2, cpu, prefetch=0)


def test_worker_processes_start_the_next_epoch_before_this_one_ends(folder):
    # 3 batches an epoch, 4 in flight: the last batch of an epoch is handed out with the
    # next epoch's first three already started, and the batches stay the serial ones.
    kw = dict(shuffle=True, seed=3)
    serial = SerialLoader(make_dataset("folder", folder), 4, **kw)
    expected = batches(serial, 3 * serial.batches_per_epoch)
    with ProcessLoader(make_dataset("folder", folder), 4, num_workers=2, prefetch_batches=2,
                       **kw) as loader:
        got = batches(loader, serial.batches_per_epoch)
        assert [key for key, _, _ in loader._pending] == [(1, 0), (1, 1), (1, 2)]
        got += batches(loader, 2 * serial.batches_per_epoch)
        assert_same(expected, got)
        assert loader.epoch == 3


def test_threads_keep_to_the_epoch_they_are_in():
    # Per-sample threads augment with the dataset's current epoch: nothing of the next
    # epoch may start before it begins.
    with ThreadLoader(array_set(12), 4, num_threads=2, prefetch_batches=4) as loader:
        batches(loader, 2)
        assert [key for key, _, _ in loader._pending] == [(0, 2)]


def test_forkserver_workers_give_the_serial_batches(folder):
    # The start method used when CUDA is initialized in the training process.
    dataset = ImageFolder(folder, train=True, image_size=8, seed=1)
    expected = batches(SerialLoader(dataset, 5, seed=2), 3)
    with ProcessLoader(dataset, 5, num_workers=2, start_method="forkserver", seed=2) as loader:
        assert_same(expected, batches(loader, 3))


class StagedSet:
    """A dataset in two stages; each batch reports how many batches its worker had started
    when it was finished."""

    def __init__(self, n):
        self.n, self.started = n, 0

    def __len__(self):
        return self.n

    def start_batch(self, indices):
        self.started += 1
        return indices

    def finish_batch(self, indices):
        return torch.tensor(indices), torch.tensor(self.started)


def test_a_staged_dataset_has_the_next_batch_started_before_this_one_finishes():
    with ProcessLoader(StagedSet(40), 4, num_workers=1, prefetch_batches=4,
                       shuffle=False) as loader:
        got = [next(loader) for _ in range(10)]
    assert torch.equal(torch.cat([idx for idx, _ in got]), torch.arange(40))
    ahead = [int(started) - (k + 1) for k, (_, started) in enumerate(got)]
    assert max(ahead) == 1 and min(ahead) >= 0  # one batch started ahead, never more
