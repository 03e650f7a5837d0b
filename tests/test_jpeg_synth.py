import pytest
from PIL import Image

from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_synth import MARKER, make_jpeg_folder


def files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))


def test_layout_stats_and_readable(tmp_path):
    out = tmp_path / "jpeg"
    stats = make_jpeg_folder(out, num_images=7, width=64, height=48, num_classes=3,
                             progress=False)
    assert files(out)[:3] == ["class_000/img_000000.jpg", "class_000/img_000003.jpg",
                              "class_000/img_000006.jpg"]
    assert len(files(out)) == 7 and stats["num_images"] == 7 and stats["num_classes"] == 3
    sizes = [p.stat().st_size for p in out.rglob("*.jpg")]
    assert stats["total_bytes"] == sum(sizes) and stats["mean_bytes"] == sum(sizes) / 7
    with Image.open(out / "class_001" / "img_000001.jpg") as im:
        assert im.format == "JPEG" and im.size == (64, 48) and im.mode == "RGB"
    ds = ImageFolder(out, train=True, image_size=32)
    assert ds.classes == ["class_000", "class_001", "class_002"] and ds[6][0].shape == (3, 32, 32)


def test_deterministic_per_seed(tmp_path):
    a = make_jpeg_folder(tmp_path / "a", 4, 40, 30, num_classes=2, seed=1, progress=False)
    b = make_jpeg_folder(tmp_path / "b", 4, 40, 30, num_classes=2, seed=1, progress=False)
    c = make_jpeg_folder(tmp_path / "c", 4, 40, 30, num_classes=2, seed=2, progress=False)
    name = "class_001/img_000003.jpg"
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    assert a["total_bytes"] == b["total_bytes"] != c["total_bytes"]


def test_file_size_is_imagenet_like(tmp_path):
    stats = make_jpeg_folder(tmp_path / "j", 4, 500, 375, num_classes=4, quality=90,
                             progress=False)
    assert 50_000 <= stats["mean_bytes"] <= 150_000


def test_overwrite_rules(tmp_path):
    out = tmp_path / "j"
    make_jpeg_folder(out, 6, 32, 32, num_classes=3, progress=False)
    (out / "mine.txt").write_text("keep me")
    make_jpeg_folder(out, 2, 32, 32, num_classes=2, progress=False)  # previous output: replaced
    assert files(out) == ["class_000/img_000000.jpg", "class_001/img_000001.jpg"]
    assert (out / "mine.txt").read_text() == "keep me" and (out / MARKER).is_file()

    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(ValueError, match="not empty") as e:
        make_jpeg_folder(other, 2, 32, 32, num_classes=2, progress=False)
    assert "new or empty folder" in str(e.value)
    assert (other / "holiday.jpg").read_bytes() == b"precious"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_images=0), "num_images >= 1"), (dict(width=4), "at least 8x8"),
    (dict(quality=0), "quality"), (dict(num_classes=0), "num_classes >= 1"),
    (dict(num_classes=3), "cannot fill 3 class folders")])
def test_bad_arguments(tmp_path, kwargs, message):
    args = dict(num_images=2, width=32, height=32, num_classes=2) | kwargs
    with pytest.raises(ValueError, match=message):
        make_jpeg_folder(tmp_path / "j", progress=False, **args)
