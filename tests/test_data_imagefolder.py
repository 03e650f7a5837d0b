import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from kasoku.core.errors import DataError
from kasoku.data.imagefolder import ImageFolder, _draft, imagefolder_datasets
from kasoku.data.transforms import IMAGENET_MEAN, IMAGENET_STD, center_crop_box, normalize


def photo(width, height, seed=0):
    """A smooth image with detail, so crops, flips and draft decodes are distinguishable."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) % 256], axis=-1)
    img = img + rng.integers(0, 30, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_folder(root, per_class=3, size=(48, 40)):
    for c, name in enumerate(["zebra", "apple"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            suffix = [".jpg", ".JPEG", ".png"][i % 3]
            photo(*size, seed=10 * c + i).save(root / name / f"im{i}{suffix}")
        (root / name / "notes.txt").write_text("not an image")
    return root


def test_scan_classes_samples(tmp_path):
    ds = ImageFolder(make_folder(tmp_path), train=True, image_size=32)
    assert ds.classes == ["apple", "zebra"]
    assert len(ds) == 6 and [label for _, label in ds.samples] == [0, 0, 0, 1, 1, 1]
    assert {p.suffix for p, _ in ds.samples} == {".jpg", ".JPEG", ".png"}


@pytest.mark.parametrize("train", [True, False])
def test_getitem_shapes_and_normalization(tmp_path, train):
    ds = ImageFolder(make_folder(tmp_path), train=train, image_size=32)
    x, t = ds[4]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32)
    assert t.dtype == torch.int64 and int(t) == 1
    assert -2.2 < float(x.min()) and float(x.max()) < 2.7  # ImageNet-normalized range


def test_train_augmentation_is_keyed_on_seed_epoch_index(tmp_path):
    ds = ImageFolder(make_folder(tmp_path), train=True, image_size=24, seed=5)
    ds.set_epoch(1)
    a = ds[2][0]
    assert torch.equal(a, ds[2][0])
    clone = pickle.loads(pickle.dumps(ds))  # a worker process
    assert torch.equal(clone[2][0], a)
    views = []
    for epoch in range(2, 6):
        ds.set_epoch(epoch)
        views.append(ds[2][0])
    assert any(not torch.equal(v, a) for v in views)
    other = ImageFolder(tmp_path, train=True, image_size=24, seed=6)
    other.set_epoch(1)
    assert not torch.equal(other[2][0], a)


def test_val_is_resize_then_center_crop(tmp_path):
    (tmp_path / "a").mkdir()
    img = photo(80, 60)
    img.save(tmp_path / "a" / "x.png")
    ds = ImageFolder(tmp_path, train=False, image_size=28)  # resize shorter side to 32
    ref = img.resize((43, 32), Image.BILINEAR).crop(center_crop_box(32, 43, 28))
    ref = torch.from_numpy(np.asarray(ref).copy()).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(ds[0][0], normalize(ref, IMAGENET_MEAN, IMAGENET_STD))


def test_large_jpeg_uses_reduced_decode_and_stays_close(tmp_path):
    (tmp_path / "a").mkdir()
    img = photo(1024, 768)
    img.save(tmp_path / "a" / "big.jpg", quality=95)
    img.save(tmp_path / "a" / "big.png")
    ds = ImageFolder(tmp_path, train=False, image_size=64)
    jpeg, png = ds[0][0], ds[1][0]  # same picture: drafted JPEG decode vs full PNG decode
    assert jpeg.shape == png.shape == (3, 64, 64)
    assert float((jpeg - png).abs().mean()) < 0.15
    train = ImageFolder(tmp_path, train=True, image_size=64)
    assert train[0][0].shape == (3, 64, 64)
    with Image.open(tmp_path / "a" / "big.jpg") as im:  # 768 // 73 = 10: decode at 1/8
        assert _draft(im, 10) == 8.0 and im.size == (128, 96)


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty", "truncated_png"])
def test_bad_image_file_is_a_data_error_naming_it(tmp_path, content):
    make_folder(tmp_path)
    buf = io.BytesIO()
    fmt = "PNG" if content == "truncated_png" else "JPEG"
    photo(200, 150).save(buf, fmt)
    data = {"garbage": b"this is not a JPEG at all" * 10, "empty": b"",
            "truncated": buf.getvalue()[: len(buf.getvalue()) // 2],
            "truncated_png": buf.getvalue()[: len(buf.getvalue()) // 2]}[content]
    bad = tmp_path / "apple" / "zz_bad.jpg"
    bad.write_bytes(data)
    for train in (True, False):
        ds = ImageFolder(tmp_path, train=train, image_size=32, strict=True)
        index = [p for p, _ in ds.samples].index(bad)
        with pytest.raises(DataError) as e:
            ds[index]
        assert str(bad) in str(e.value)


def test_folder_errors(tmp_path):
    with pytest.raises(DataError, match="make-jpeg") as e:
        ImageFolder(tmp_path / "nope", train=True)
    assert "does not exist" in str(e.value)
    (tmp_path / "loose.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="no class folders"):
        ImageFolder(tmp_path, train=True)
    make_folder(tmp_path / "r")
    (tmp_path / "r" / "empty_class").mkdir()
    (tmp_path / "r" / "empty_class" / "readme.txt").write_text("x")
    with pytest.raises(DataError) as e:
        ImageFolder(tmp_path / "r", train=True)
    assert str(tmp_path / "r" / "empty_class") in str(e.value)


def test_imagefolder_datasets_layouts(tmp_path):
    make_folder(tmp_path / "flat")
    train, val = imagefolder_datasets(tmp_path / "flat", image_size=32)
    assert len(train) == 6 and train.train and val is None
    make_folder(tmp_path / "split" / "train")
    train, val = imagefolder_datasets(tmp_path / "split", image_size=32)
    assert train.root == tmp_path / "split" / "train" and val is None
    make_folder(tmp_path / "split" / "val", per_class=1)
    train, val = imagefolder_datasets(tmp_path / "split", image_size=32)
    assert len(val) == 2 and not val.train and val.classes == train.classes
    (tmp_path / "split" / "val" / "zebra").rename(tmp_path / "split" / "val" / "horse")
    with pytest.raises(DataError, match="different class folders"):
        imagefolder_datasets(tmp_path / "split")
    with pytest.raises(DataError, match="does not exist"):
        imagefolder_datasets(tmp_path / "missing")
