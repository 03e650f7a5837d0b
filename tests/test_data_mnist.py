import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from kasoku.core.errors import DataError
from kasoku.data import mnist
from kasoku.data.mnist import load_mnist, mnist_datasets, read_idx


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file in the real format: 00 00 08 ndim, big-endian uint32 dims, uint8 payload."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, n_train=12, n_test=5, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{prefix}-{kind}-ubyte"
            data = idx_bytes(arr)
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return folder


def test_read_idx_raw_and_gzip_by_magic_not_name(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "raw.gz").write_bytes(idx_bytes(arr))           # raw, despite the name
    (tmp_path / "packed").write_bytes(gzip.compress(idx_bytes(arr)))  # gzip, without .gz
    for name in ("raw.gz", "packed"):
        t = read_idx(tmp_path / name)
        assert t.dtype == torch.uint8 and t.shape == (2, 3, 4)
        assert torch.equal(t, torch.from_numpy(arr))
    (tmp_path / "labels").write_bytes(idx_bytes(np.array([3, 1, 4], dtype=np.uint8)))
    assert read_idx(tmp_path / "labels").tolist() == [3, 1, 4]


@pytest.mark.parametrize("cut,word", [(-5, "truncated"), (+3, "extra bytes")])
def test_read_idx_payload_size_mismatch(tmp_path, cut, word):
    data = idx_bytes(np.zeros((4, 28, 28), dtype=np.uint8))
    data = data[:cut] if cut < 0 else data + b"\0" * cut
    path = tmp_path / "bad-idx3-ubyte"
    path.write_bytes(data)
    with pytest.raises(DataError) as e:
        read_idx(path)
    msg = str(e.value)
    assert str(path) in msg and word in msg
    assert "3136 payload bytes" in msg and str(3136 + cut) in msg


@pytest.mark.parametrize("header", [b"\x00\x00\x0d\x03", b"\x01\x00\x08\x03", b"\x00\x00\x08\x02",
                                    b"<!DOCTYPE html>"])
def test_read_idx_wrong_magic(tmp_path, header):
    path = tmp_path / "x-ubyte"
    path.write_bytes(header + b"\0" * 64)
    with pytest.raises(DataError, match="magic number") as e:
        read_idx(path)
    assert str(path) in str(e.value)


def test_read_idx_short_header_and_empty(tmp_path):
    (tmp_path / "short").write_bytes(b"\x00\x00\x08\x03\x00\x00\x00\x02")
    with pytest.raises(DataError, match="header needs 16 bytes"):
        read_idx(tmp_path / "short")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(DataError, match="too short"):
        read_idx(tmp_path / "empty")


def test_read_idx_truncated_gzip(tmp_path):
    packed = gzip.compress(idx_bytes(np.ones((50, 28, 28), dtype=np.uint8) * 7))
    path = tmp_path / "cut.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match="gzip") as e:
        read_idx(path)
    assert str(path) in str(e.value)
    corrupt = bytearray(packed)
    corrupt[20:40] = b"\xff" * 20
    path.write_bytes(bytes(corrupt))
    with pytest.raises(DataError, match="gzip"):
        read_idx(path)


@pytest.mark.parametrize("gz", [True, False])
def test_load_mnist_small_files(tmp_path, gz):
    write_mnist(tmp_path, gz=gz)
    images, labels = load_mnist(tmp_path, train=True)
    assert images.shape == (12, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (12,) and labels.dtype == torch.int64
    assert load_mnist(tmp_path, train=False)[0].shape == (5, 28, 28)


def test_load_mnist_count_mismatch_and_bad_label(tmp_path):
    write_mnist(tmp_path)
    labels_path = tmp_path / "train-labels-idx1-ubyte.gz"
    labels_path.write_bytes(gzip.compress(idx_bytes(np.zeros(11, dtype=np.uint8))))
    with pytest.raises(DataError, match="12 images but .* 11 labels"):
        load_mnist(tmp_path, train=True)
    labels_path.write_bytes(gzip.compress(idx_bytes(np.array([1] * 11 + [10], dtype=np.uint8))))
    with pytest.raises(DataError, match="label 10 at index 11"):
        load_mnist(tmp_path, train=True)


def test_mnist_datasets_shapes_transform_and_pickle(tmp_path):
    write_mnist(tmp_path)
    train, val = mnist_datasets(tmp_path)
    assert len(train) == 12 and len(val) == 5
    assert train.inputs.dtype == torch.uint8 and train.inputs.shape == (12, 1, 28, 28)
    x, t = train.get_batch(torch.tensor([0, 3]))
    assert x.dtype == torch.float32 and x.shape == (2, 1, 28, 28)
    assert float(x.min()) >= 0 and float(x.max()) <= 1
    torch.testing.assert_close(x, train.inputs[[0, 3]].float() / 255)
    assert t.dtype == torch.int64
    clone = pickle.loads(pickle.dumps(train))  # datasets go to worker processes by pickle
    assert torch.equal(clone.get_batch(torch.tensor([0, 3]))[0], x)


@pytest.mark.parametrize("make_folder", [True, False])
def test_missing_mnist_says_what_to_do(tmp_path, make_folder):
    root = tmp_path / "mnist"
    if make_folder:
        root.mkdir()
    with pytest.raises(DataError) as e:
        mnist_datasets(root)
    msg = str(e.value)
    for needle in ("train-images-idx3-ubyte.gz", str(root), "t10k-labels-idx1-ubyte.gz",
                   f"kasoku data download mnist --out {root}", "--download", "--synthetic"):
        assert needle in msg
    assert ("does not exist" in msg) != make_folder


def test_mnist_datasets_download_fetches_first(tmp_path, monkeypatch):
    calls = []

    def fake_fetch(name, root, base_url=None):
        calls.append(name)
        write_mnist(root)
        return root

    monkeypatch.setattr("kasoku.data.download.fetch_dataset", fake_fetch)
    train, _ = mnist_datasets(tmp_path / "new", download=True)
    assert calls == ["mnist"] and len(train) == 12


def test_real_mnist(mnist_dir):
    images, labels = load_mnist(mnist_dir, train=True)
    assert images.shape == (60000, 28, 28) and labels.shape == (60000,)
    counts = torch.bincount(labels, minlength=10)
    assert counts.sum() == 60000 and len(counts) == 10 and counts.min() > 5000
    assert labels[:5].tolist() == [5, 0, 4, 1, 9]  # the well-known first training digits
    images, labels = load_mnist(mnist_dir, train=False)
    assert images.shape == (10000, 28, 28) and labels[:3].tolist() == [7, 2, 1]
    assert mnist.FILES[True][0] in {p.name for p in mnist_dir.iterdir()}
