"""The gpu-jpeg loader: its batched crop against PyTorch's own resize, and its batches against
the serial loader's (same samples, labels, crop boxes and flips) on real JPEG files. On this
CPU-only machine the Pillow decoder feeds the same batched crop; the CUDA test runs where a GPU
is present."""
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from kasoku.core.errors import ConfigError, DataError, reset_warnings
from kasoku.data.gpu_jpeg import GpuJpegLoader, crop_resize_normalize, val_box
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_synth import make_jpeg_folder
from kasoku.data.loader import SerialLoader

SIZE = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_jpeg") / "images"
    make_jpeg_folder(root, 20, 96, 72, num_classes=4, progress=False)
    # Images of another size and orientation in the same batches.
    for i in range(4):
        Image.open(root / "class_000" / "img_000000.jpg").resize((50, 90)).save(
            root / f"class_00{i}" / f"tall_{i}.jpg", quality=90)
    return root


def loaders(root, train=True, batch_size=8, **kwargs):
    serial = SerialLoader(ImageFolder(root, train=train, image_size=SIZE, seed=5), batch_size,
                          shuffle=train, **kwargs)
    gpu = GpuJpegLoader(ImageFolder(root, train=train, image_size=SIZE, seed=5), batch_size,
                        device="cpu", num_threads=2, shuffle=train, **kwargs)
    return serial, gpu


def assert_same_views(expected, got, tolerance=0.2):
    """Same labels; each image close to the serial one (Pillow's filtered resize vs bilinear)
    and far closer to it than to its mirror image, so crop boxes and flips agree."""
    (xa, ya), (xb, yb) = expected, got
    assert torch.equal(ya, yb)
    assert xb.shape == xa.shape and xb.dtype == torch.float32
    diff = (xa - xb).abs().mean(dim=(1, 2, 3))
    mirrored = (xa.flip(-1) - xb).abs().mean(dim=(1, 2, 3))
    assert diff.max() < tolerance, diff
    assert (diff < 2 * tolerance * mirrored).all(), (diff, mirrored)


def hwc_images(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
            for h, w in [(30, 40), (17, 23), (64, 20)]]


def flat_inputs(images, layout):
    tensors = [im if layout == "hwc" else im.permute(2, 0, 1).contiguous() for im in images]
    offsets = torch.tensor(np.cumsum([0] + [t.numel() for t in tensors[:-1]]))
    shapes = torch.tensor([im.shape[:2] for im in images])
    strides = torch.tensor([(3 * w, 3, 1) if layout == "hwc" else (w, 1, h * w)
                            for h, w in shapes.tolist()])
    return torch.cat([t.reshape(-1) for t in tensors]), offsets, shapes, strides


@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_batched_crop_equals_torch_bilinear_resize_of_each_crop(layout):
    images = hwc_images()
    boxes = torch.tensor([(3, 5, 20, 30), (0, 0, 17, 23), (10, 2, 40, 15)], dtype=torch.float32)
    flips = torch.tensor([False, True, False])
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    got = crop_resize_normalize(*flat_inputs(images, layout), boxes, flips, 12, mean, std)
    for b, (img, (t, l, h, w)) in enumerate(zip(images, boxes.long().tolist())):
        crop = img.permute(2, 0, 1)[None, :, t:t + h, l:l + w].float()
        want = F.interpolate(crop, size=(12, 12), mode="bilinear", align_corners=False)[0]
        want = want.flip(-1) if flips[b] else want
        want = (want / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
        torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def kernel_table(tensors, layout, boxes, flips):
    """The kernel's table for separate images: each one's distance from the first."""
    base = tensors[0]
    rows = []
    for t, box, flip in zip(tensors, boxes.tolist(), flips.tolist()):
        if layout == "hwc":
            (h, w), strides = t.shape[:2], (t.stride(0), t.stride(1), t.stride(2))
        else:
            (h, w), strides = t.shape[1:], (t.stride(1), t.stride(2), t.stride(0))
        rows.append([t.data_ptr() - base.data_ptr(), h, w, *strides, *box, float(flip), 0])
    return base, torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_crop_kernel_equals_the_torch_crop(interpreter, layout):
    from kasoku.data.crop_kernel import crop_resize_normalize_kernel
    images = hwc_images(3)
    # Boxes inside, fractional, reaching past the edges, and upscaling a sliver.
    boxes = torch.tensor([[2.0, 3.5, 20.25, 30.0], [0.0, 0.0, 17.0, 23.0],
                          [50.5, -1.0, 13.0, 25.0]])
    flips = torch.tensor([False, True, True])
    flat, offsets, shapes, strides = flat_inputs(images, layout)
    want = crop_resize_normalize(flat, offsets, shapes, strides, boxes, flips, 16,
                                 (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tensors = [im if layout == "hwc" else im.permute(2, 0, 1).contiguous() for im in images]
    base, table = kernel_table(tensors, layout, boxes, flips)
    got = crop_resize_normalize_kernel(base, table, 16, (0.485, 0.456, 0.406),
                                       (0.229, 0.224, 0.225))
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_crop_kernel_reads_strided_images_where_they_lie(interpreter):
    # A pitched image (rows padded, as a decoder may return them) and a channels-first view
    # of an HWC buffer: no copies, the strides say where each pixel is.
    from kasoku.data.crop_kernel import crop_resize_normalize_kernel
    g = torch.Generator().manual_seed(1)
    padded = torch.randint(0, 256, (30, 48, 3), generator=g, dtype=torch.uint8)
    pitched = padded[:, :40]
    assert not pitched.is_contiguous()
    boxes, flips = torch.tensor([[1.0, 2.0, 25.0, 33.0]]), torch.tensor([True])
    flat, offsets, shapes, strides = flat_inputs([pitched.contiguous()], "hwc")
    want = crop_resize_normalize(flat, offsets, shapes, strides, boxes, flips, 12,
                                 (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    for tensor, layout in ((pitched, "hwc"), (pitched.permute(2, 0, 1), "chw")):
        base, table = kernel_table([tensor], layout, boxes, flips)
        got = crop_resize_normalize_kernel(base, table, 12, (0.5, 0.5, 0.5),
                                           (0.25, 0.25, 0.25))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_the_loader_crops_alike_with_the_kernel_and_with_torch_ops(interpreter, folder,
                                                                  monkeypatch):
    def first_batches(count):
        with GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 8,
                           device="cpu", num_threads=2, seed=3) as loader:
            return [next(loader) for _ in range(count)]

    with_kernel = first_batches(2)
    monkeypatch.setenv("KASOKU_CROP_KERNEL", "torch")
    for (xa, ya), (xb, yb) in zip(first_batches(2), with_kernel):
        assert torch.equal(ya, yb)
        torch.testing.assert_close(xb, xa, rtol=0, atol=1e-4)


def test_val_box_is_the_resize_then_centre_crop_of_imagefolder():
    # 500x375 -> shorter side 256 (341x256), centre 224 at (left 58, top 16): x1.4648 back.
    top, left, h, w = val_box(375, 500, 224)
    scale = 375 / 256
    assert (top, h) == pytest.approx((16 * scale, 224 * scale))
    assert (left, w) == pytest.approx((58 * 500 / 341, 224 * 500 / 341))


@pytest.mark.parametrize("train", [True, False])
def test_same_samples_crops_and_flips_as_serial_over_two_epochs(folder, train):
    serial, gpu = loaders(folder, train=train)
    with gpu:
        for _ in range(2 * serial.batches_per_epoch):  # the last batch is incomplete
            assert_same_views(next(serial), next(gpu))
        assert gpu.epoch == serial.epoch == 2


def test_the_next_epoch_is_started_before_this_one_ends(folder):
    serial, _ = loaders(folder, batch_size=8)
    gpu = GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 8,
                        device="cpu", num_threads=2, prefetch_batches=4)
    with gpu:
        per_epoch = serial.batches_per_epoch
        for _ in range(per_epoch):
            assert_same_views(next(serial), next(gpu))
        assert [key for key, _, _ in gpu._pending] == [(1, k) for k in range(3)]
        for _ in range(2 * per_epoch):  # crops and flips drawn for the epoch of each batch
            assert_same_views(next(serial), next(gpu))


def test_sharded_ranks_get_the_serial_shards(folder):
    for rank in range(2):
        serial, gpu = loaders(folder, batch_size=5, rank=rank, world_size=2, seed=9)
        with gpu:
            for _ in range(serial.batches_per_epoch + 1):
                assert_same_views(next(serial), next(gpu))


def test_exact_mid_epoch_resume(folder):
    _, first = loaders(folder, seed=2)
    with first:
        for _ in range(2):
            next(first)
        state = first.state_dict()
        expected = [next(first) for _ in range(3)]  # crosses into epoch 1
    _, resumed = loaders(folder, seed=2)
    with resumed:
        resumed.load_state_dict(state)
        for want, got in zip(expected, [next(resumed) for _ in range(3)]):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_work_in_flight_is_discarded_when_the_state_moves(folder):
    _, loader = loaders(folder, seed=4)
    with loader:
        reference = [next(loader) for _ in range(3)]
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "position": 1})
        assert torch.equal(next(loader)[0], reference[1][0])


@pytest.fixture
def bad_folder(tmp_path):
    root = tmp_path / "bad"
    make_jpeg_folder(root, 12, 48, 40, num_classes=3, progress=False)
    (root / "class_001" / "img_000001.jpg").write_bytes(b"this is not a jpeg")
    (root / "class_002" / "img_000002.jpg").write_bytes(b"")
    Image.open(root / "class_000" / "img_000000.jpg").save(root / "class_000" / "extra.png")
    return root


def test_bad_files_are_skipped_warned_once_counted_and_replaced_like_serial(bad_folder):
    serial, gpu = loaders(bad_folder, batch_size=4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the serial loader's own warnings are not counted
        expected = [next(serial) for _ in range(2 * serial.batches_per_epoch)]
    reset_warnings()  # the serial loader's warning is said once per process: say it again
    with gpu, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for want in expected:
            assert_same_views(want, next(gpu))
        assert gpu.skipped == 2
        assert sorted((os.path.basename(r.path), r.reason) for r in gpu.skipped_records) == \
            [("img_000001.jpg", "not an image"), ("img_000002.jpg", "empty")]
        assert set(gpu.skipped_records) == set(serial.skipped_records)  # files and reasons
    mine = [str(w.message) for w in caught if str(w.message).startswith("skipping bad file")]
    assert len(mine) == 1  # the first bad file is warned; the second is only counted


def test_strict_raises_naming_the_file(bad_folder):
    dataset = ImageFolder(bad_folder, train=True, image_size=SIZE, strict=True)
    with GpuJpegLoader(dataset, 13, device="cpu", num_threads=2, shuffle=False) as loader:
        with pytest.raises(DataError, match="img_00000[12].jpg"):
            next(loader)


def test_make_loader_builds_it_and_refuses_in_memory_datasets(folder):
    from kasoku.data.base import ArrayDataset
    from kasoku.data.registry import create_loader, parse_loader_spec
    kind, count = parse_loader_spec("gpu-jpeg:3")
    assert (kind.name, count) == ("gpu-jpeg", 3)
    dataset = ImageFolder(folder, train=True, image_size=SIZE)
    with create_loader("gpu-jpeg:2", dataset, 4, torch.device("cpu")) as loader:
        assert isinstance(loader, GpuJpegLoader) and loader.num_threads == 2
        assert next(loader)[0].shape == (4, 3, SIZE, SIZE)
    arrays = ArrayDataset(torch.zeros(8, 1, 4, 4), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ConfigError, match="JPEG folders"):
        create_loader("gpu-jpeg", arrays, 4, torch.device("cpu"))


def test_unknown_decoder_is_refused(folder, monkeypatch):
    monkeypatch.setenv("KASOKU_GPU_JPEG_DECODER", "libjpeg")
    with pytest.raises(ValueError, match="unknown JPEG decoder"):
        GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE), 4, device="cpu")


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("decoder", [
    "auto", "pillow",
    pytest.param("torchvision", marks=pytest.mark.skipif(
        not _importable("torchvision"), reason="torchvision is not installed")),
    pytest.param("nvimgcodec", marks=pytest.mark.skipif(
        not _importable("nvidia.nvimgcodec"), reason="nvImageCodec is not installed"))])
def test_cuda_batches_match_serial(folder, decoder):
    serial = SerialLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 8)
    gpu = GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 8,
                        device="cuda", decoder=decoder)
    with gpu:
        for _ in range(2 * serial.batches_per_epoch):
            x, y = next(gpu)
            assert x.is_cuda and y.is_cuda
            # nvJPEG's chroma upsampling and IDCT differ from libjpeg's: a looser bound.
            assert_same_views(next(serial), (x.cpu(), y.cpu()),
                              tolerance=0.2 if decoder == "pillow" else 0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decoder", ["torchvision", "nvimgcodec", "pillow"])
def test_cuda_crop_kernel_matches_torch_ops(folder, decoder, monkeypatch):
    pytest.importorskip("triton")

    def first_batches():
        try:
            loader = GpuJpegLoader(ImageFolder(folder, train=True, image_size=SIZE, seed=5), 8,
                                   device="cuda", decoder=decoder, seed=1)
        except ValueError as exc:  # this decoder is not installed here
            pytest.skip(str(exc))
        with loader:
            return [tuple(t.cpu() for t in next(loader)) for _ in range(3)]

    with_kernel = first_batches()
    monkeypatch.setenv("KASOKU_CROP_KERNEL", "torch")
    for (xa, ya), (xb, yb) in zip(first_batches(), with_kernel):
        assert torch.equal(ya, yb)
        torch.testing.assert_close(xb, xa, rtol=0, atol=1e-4)
