import os
import pickle

import numpy as np
import pytest
import torch

from kasoku.core.errors import ConfigError, DataError
from kasoku.data.cifar10 import (
    HOLDOUT_NAME,
    cifar10_datasets,
    load_cifar10,
    read_cifar_bin,
    read_cifar_pickle,
)


def random_batch(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8),
            rng.integers(0, 10, size=n, dtype=np.uint8))


def write_bin(path, images, labels):
    """The binary version's format: per record 1 label byte then R, G, B planes of 32x32."""
    records = np.concatenate([labels.reshape(-1, 1), images.reshape(len(images), -1)], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(records.astype(np.uint8).tobytes())


def write_py(path, images, labels):
    """The python version's format: a protocol-2 pickle of a dict with bytes keys."""
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": [int(v) for v in labels],
             b"data": images.reshape(len(images), 3072),
             b"filenames": [b"img_%d.png" % i for i in range(len(images))]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(batch, protocol=2))


def make_cifar(root, n=20, layout="bin"):
    for b in range(1, 6):
        images, labels = random_batch(n, seed=b)
        if layout == "bin":
            write_bin(root / "cifar-10-batches-bin" / f"data_batch_{b}.bin", images, labels)
        elif layout == "flat":
            write_bin(root / f"data_batch_{b}.bin", images, labels)
        else:
            write_py(root / "cifar-10-batches-py" / f"data_batch_{b}", images, labels)
    return root


def test_read_cifar_bin_roundtrip(tmp_path):
    images, labels = random_batch(7, seed=0)
    write_bin(tmp_path / "b.bin", images, labels)
    x, y = read_cifar_bin(tmp_path / "b.bin")
    assert x.dtype == torch.uint8 and x.shape == (7, 3, 32, 32)
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    assert torch.equal(x, torch.from_numpy(images))


@pytest.mark.parametrize("size", [0, 3073 * 2 - 1, 3072])
def test_read_cifar_bin_wrong_size(tmp_path, size):
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(b"\1" * size)
    with pytest.raises(DataError) as e:
        read_cifar_bin(path)
    msg = str(e.value)
    assert str(path) in msg and f"size {size} bytes" in msg and "3073" in msg


def test_read_cifar_bin_bad_label(tmp_path):
    images, labels = random_batch(3, seed=0)
    labels[2] = 11
    write_bin(tmp_path / "b.bin", images, labels)
    with pytest.raises(DataError, match="label 11 of record 2"):
        read_cifar_bin(tmp_path / "b.bin")


def test_read_cifar_pickle_python_version(tmp_path):
    images, labels = random_batch(9, seed=1)
    write_py(tmp_path / "data_batch_1", images, labels)
    raw = (tmp_path / "data_batch_1").read_bytes()
    assert raw[:2] == b"\x80\x02"  # protocol 2, as the official Python 2 files
    x, y = read_cifar_pickle(tmp_path / "data_batch_1")
    assert x.shape == (9, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(images)) and y.tolist() == labels.tolist()
    # numpy 1.x (and the official files) name numpy.core.multiarray; numpy 2 numpy._core.
    old = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "old").write_bytes(old)
    assert torch.equal(read_cifar_pickle(tmp_path / "old")[0], x)


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class _Open:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("kind", ["system", "open"])
def test_restricted_unpickler_refuses_hostile_pickle(tmp_path, kind):
    marker = tmp_path / "pwned"
    payload = _System(f"touch {marker}") if kind == "system" else _Open(str(marker))
    images, labels = random_batch(2, seed=0)
    evil = {b"data": images.reshape(2, -1), b"labels": [1, 2], b"x": payload}
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(DataError, match="refused to load global") as e:
        read_cifar_pickle(path)
    assert str(path) in str(e.value)
    assert ("system" in str(e.value)) == (kind == "system")
    assert not marker.exists()


def test_read_cifar_pickle_damaged(tmp_path):
    images, labels = random_batch(2, seed=0)
    write_py(tmp_path / "b", images, labels)
    data = (tmp_path / "b").read_bytes()
    (tmp_path / "b").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="not a readable CIFAR-10 python batch"):
        read_cifar_pickle(tmp_path / "b")
    (tmp_path / "c").write_bytes(pickle.dumps({b"labels": [1]}, protocol=2))
    with pytest.raises(DataError, match="no 'data' entry"):
        read_cifar_pickle(tmp_path / "c")


@pytest.mark.parametrize("layout", ["bin", "flat", "py"])
def test_load_cifar10_layouts(tmp_path, layout):
    make_cifar(tmp_path, n=4, layout=layout)
    x, y = load_cifar10(tmp_path, [2, 5])
    assert x.shape == (8, 3, 32, 32) and y.shape == (8,)
    assert torch.equal(x[:4], torch.from_numpy(random_batch(4, seed=2)[0]))


@pytest.mark.parametrize("make_folder", [True, False])
def test_missing_cifar10_says_what_to_do(tmp_path, make_folder):
    root = tmp_path / "c10"
    if make_folder:
        root.mkdir()
    with pytest.raises(DataError) as e:
        cifar10_datasets(root)
    msg = str(e.value)
    for needle in ("data_batch_1.bin", "cifar-10-batches-bin", str(root),
                   f"kasoku data download cifar10 --out {root}", "--download", "--synthetic"):
        assert needle in msg


def test_cifar10_datasets_protocol_and_normalization(tmp_path):
    make_cifar(tmp_path, n=20)
    train, val = cifar10_datasets(tmp_path)
    assert len(train) == 80 and len(val) == 20 and val.name == HOLDOUT_NAME
    assert train.inputs.dtype == torch.uint8
    x, t = val.get_batch(torch.arange(20))
    assert x.dtype == torch.float32 and x.shape == (20, 3, 32, 32) and t.dtype == torch.int64
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    torch.testing.assert_close(x, (val.inputs.float() / 255 - mean) / std)
    with pytest.raises(ConfigError, match="both the train and val"):
        cifar10_datasets(tmp_path, train_batches=(1, 2, 5))
    with pytest.raises(ConfigError, match="does not exist"):
        cifar10_datasets(tmp_path, train_batches=(0,), val_batches=())
    assert cifar10_datasets(tmp_path, train_batches=(1,), val_batches=())[1] is None


def test_augmentation_depends_only_on_seed_epoch_index(tmp_path):
    make_cifar(tmp_path, n=20)
    train, _ = cifar10_datasets(tmp_path, augment=True, seed=3)
    train.set_epoch(2)
    full = train.get_batch(torch.arange(80))[0]
    part = train.get_batch(torch.tensor([50, 7, 13]))[0]
    assert torch.equal(part, full[[50, 7, 13]])  # independent of batch composition
    assert torch.equal(train[13][0], full[13])
    clone = pickle.loads(pickle.dumps(train))  # another process, or a resumed run
    clone.set_epoch(2)
    assert torch.equal(clone.get_batch(torch.arange(80))[0], full)
    train.set_epoch(3)
    assert not torch.equal(train.get_batch(torch.arange(80))[0], full)
    other, _ = cifar10_datasets(tmp_path, augment=True, seed=4)
    other.set_epoch(2)
    assert not torch.equal(other.get_batch(torch.arange(80))[0], full)
    # The validation set and the un-augmented train set stay untouched.
    plain, val = cifar10_datasets(tmp_path)
    assert not hasattr(val, "set_epoch")
    assert not torch.equal(plain.get_batch(torch.arange(80))[0], full)


def test_augmented_batch_is_a_crop_or_mirror_of_the_padded_image(tmp_path):
    make_cifar(tmp_path, n=20)
    train, _ = cifar10_datasets(tmp_path, augment=True, seed=0)
    train.transform = None  # compare raw uint8 pixels
    x = train.get_batch(torch.arange(80))[0]
    src = np.pad(train.inputs.numpy(), ((0, 0), (0, 0), (4, 4), (4, 4)), mode="reflect")
    flips = 0
    for n in range(80):
        crops = {(dy, dx, f) for dy in range(9) for dx in range(9) for f in (0, 1)
                 if np.array_equal(x[n].numpy(),
                                   src[n, :, dy:dy + 32, dx:dx + 32][:, :, ::-1 if f else 1])}
        assert crops, f"sample {n} is not a crop of its padded image"
        flips += min(f for _, _, f in crops)
    assert 20 < flips < 60  # about half mirrored


def test_real_cifar10(cifar10_dir):
    x, y = read_cifar_bin(cifar10_dir / "cifar-10-batches-bin" / "data_batch_5.bin")
    assert x.shape == (10000, 3, 32, 32) and y.shape == (10000,)
    counts = torch.bincount(y, minlength=10)
    assert counts.sum() == 10000 and len(counts) == 10 and counts.min() > 900
    train, val = cifar10_datasets(cifar10_dir)
    assert len(train) == 40000 and len(val) == 10000 and val.name == HOLDOUT_NAME
    assert torch.equal(val.targets, y)
    xb = train.get_batch(torch.arange(0, 40000, 40))[0]
    assert abs(float(xb.mean())) < 0.1 and abs(float(xb.std()) - 1) < 0.1
    partial = cifar10_dir / "PARTIAL_test_batch_first1017.bin"
    if partial.exists():
        assert read_cifar_bin(partial)[0].shape == (1017, 3, 32, 32)
