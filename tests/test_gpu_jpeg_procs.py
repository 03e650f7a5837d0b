"""gpu-jpeg-procs: gpu-jpeg's batches made in worker processes. On this CPU-only machine the
workers decode with Pillow and crop on the CPU, batches returning through shared memory; the
CUDA test (batches handed over through CUDA IPC) runs where a GPU is present. Real JPEG files,
real processes."""
import os
import warnings

import pytest
import torch
from PIL import Image
from test_gpu_jpeg import SIZE, assert_same_views, bad_folder  # noqa: F401 - a fixture
from test_parallel_loader import assert_killing_worker_1_is_reported

from kasoku.core.errors import ConfigError, DataError, reset_warnings
from kasoku.data.gpu_jpeg import GpuJpegLoader
from kasoku.data.gpu_jpeg_procs import GpuJpegProcessLoader
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_synth import make_jpeg_folder
from kasoku.data.loader import SerialLoader


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_jpeg_procs") / "images"
    make_jpeg_folder(root, 18, 80, 60, num_classes=3, progress=False)
    Image.open(root / "class_000" / "img_000000.jpg").resize((40, 70)).save(
        root / "class_001" / "tall.jpg", quality=90)
    return root


def serial_and_procs(root, train=True, batch_size=4, workers=2, **kwargs):
    serial = SerialLoader(ImageFolder(root, train=train, image_size=SIZE, seed=5), batch_size,
                          shuffle=train, **kwargs)
    procs = GpuJpegProcessLoader(ImageFolder(root, train=train, image_size=SIZE, seed=5),
                                 batch_size, device="cpu", num_workers=workers, num_threads=2,
                                 shuffle=train, **kwargs)
    return serial, procs


@pytest.mark.parametrize("train", [True, False])
def test_same_samples_crops_and_flips_as_serial_over_two_epochs(folder, train):
    serial, procs = serial_and_procs(folder, train=train)
    with procs:
        for _ in range(2 * serial.batches_per_epoch):  # the last batch is incomplete
            assert_same_views(next(serial), next(procs))
        assert procs.epoch == serial.epoch == 2


def test_same_batches_as_the_threaded_gpu_jpeg_loader_on_two_ranks(folder):
    for rank in range(2):
        threaded = GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 3,
                                 device="cpu", num_threads=2, rank=rank, world_size=2, seed=7)
        _, procs = serial_and_procs(folder, batch_size=3, rank=rank, world_size=2, seed=7)
        with threaded, procs:
            for _ in range(threaded.batches_per_epoch + 1):
                (xa, ya), (xb, yb) = next(threaded), next(procs)
                assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_exact_mid_epoch_resume(folder):
    _, first = serial_and_procs(folder, seed=2)
    with first:
        for _ in range(2):
            next(first)
        state = first.state_dict()
        expected = [next(first) for _ in range(4)]  # crosses into epoch 1
    _, resumed = serial_and_procs(folder, seed=2)
    with resumed:
        resumed.load_state_dict(state)
        for want, got in zip(expected, [next(resumed) for _ in range(4)]):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_bad_files_are_skipped_warned_once_counted_and_replaced_like_serial(bad_folder):  # noqa: F811
    serial, procs = serial_and_procs(bad_folder, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = [next(serial) for _ in range(2 * serial.batches_per_epoch)]
    reset_warnings()  # the serial loader's warning is said once per process: say it again
    with procs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for want in expected:
            assert_same_views(want, next(procs))
        assert procs.skipped == 2
        assert sorted((os.path.basename(r.path), r.reason) for r in procs.skipped_records) == \
            [("img_000001.jpg", "not an image"), ("img_000002.jpg", "empty")]
    mine = [str(w.message) for w in caught if "skipping bad file" in str(w.message)]
    assert len(mine) == 1  # the first bad file, once over two epochs; the second is counted


def test_strict_raises_naming_the_file(bad_folder):  # noqa: F811
    dataset = ImageFolder(bad_folder, train=True, image_size=SIZE, strict=True)
    with GpuJpegProcessLoader(dataset, 12, device="cpu", num_workers=1,
                              shuffle=False) as loader:
        with pytest.raises(DataError, match="img_00000[12].jpg"):
            next(loader)


def test_killed_worker_raises_naming_it_instead_of_hanging(folder):
    assert_killing_worker_1_is_reported(serial_and_procs(folder, train=False, batch_size=2)[1])


def test_make_loader_builds_it_and_refuses_what_it_cannot_read(folder, monkeypatch):
    from kasoku.data.base import ArrayDataset
    from kasoku.data.registry import create_loader, parse_loader_spec
    kind, count = parse_loader_spec("gpu-jpeg-procs:2")
    assert (kind.name, count) == ("gpu-jpeg-procs", 2)
    dataset = ImageFolder(folder, train=True, image_size=SIZE)
    with create_loader("gpu-jpeg-procs:1", dataset, 4, torch.device("cpu")) as loader:
        assert isinstance(loader, GpuJpegProcessLoader) and loader.num_workers == 1
        assert loader.yields_device_batches
        assert next(loader)[0].shape == (4, 3, SIZE, SIZE)
    arrays = ArrayDataset(torch.zeros(8, 1, 4, 4), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ConfigError, match="JPEG folders"):
        create_loader("gpu-jpeg-procs", arrays, 4, torch.device("cpu"))
    monkeypatch.setenv("KASOKU_GPU_JPEG_DECODER", "libjpeg")
    with pytest.raises(ConfigError, match="unknown JPEG decoder"):
        create_loader("gpu-jpeg-procs", dataset, 4, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_arrive_through_ipc_and_match_serial(folder):
    serial = SerialLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 4)
    procs = GpuJpegProcessLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 4,
                                 device="cuda", num_workers=2)
    with procs:
        for _ in range(2 * serial.batches_per_epoch):
            x, y = next(procs)
            assert x.is_cuda and y.is_cuda
            assert_same_views(next(serial), (x.cpu(), y.cpu()), tolerance=0.3)
