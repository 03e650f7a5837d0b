"""MNIST from its four original IDX files (gzip or raw), validated byte for byte.

The validation split is the official 10,000-image test set (``t10k``), as in the MNIST
literature this project reproduces; MNIST has no separate held-out set.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

import kasoku.data.download
from kasoku.core.errors import DataError
from kasoku.core.flags import flag
from kasoku.data.base import ArrayDataset

FILES = {
    True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_GZIP_MAGIC = b"\x1f\x8b"
_UINT8 = 0x08


def read_idx(path: str | Path) -> torch.Tensor:
    """The uint8 array of an IDX file, shaped as its header says (1 or 3 dims).

    gzip is detected by its magic bytes, not the file name. Raises ``DataError`` naming the
    file for a bad magic number, an incomplete header, a payload of the wrong size, or a
    truncated/corrupt gzip stream.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes is too short for an IDX header (4 bytes of "
                        "magic number); the file is truncated or not an IDX file. Download it "
                        "again.")
    zero, type_code, ndim = data[0:2], data[2], data[3]
    if zero != b"\x00\x00" or type_code != _UINT8 or ndim not in (1, 3):
        raise DataError(f"{path}: magic number {data[:4].hex()} is not an IDX uint8 file of 1 or "
                        "3 dims (expected 00000801 or 00000803). Is this the right file, or a "
                        "gzip file that was decompressed twice or an HTML error page?")
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise DataError(f"{path}: header needs {header_bytes} bytes but the file has "
                        f"{len(data)}; the file is truncated. Download it again.")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64))
    actual = len(data) - header_bytes
    if actual != expected:
        what = "truncated" if actual < expected else "has extra bytes at the end"
        raise DataError(f"{path}: header says shape {shape} = {expected} payload bytes but the "
                        f"file has {actual}; it is {what}. Download it again.")
    array = np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(shape)
    return torch.from_numpy(array.copy())


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: the gzip stream is truncated or corrupt ({e}). Download the "
                        "file again.") from e


def load_mnist(root: str | Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 [N,28,28], labels int64 [N])`` of the train (60k) or t10k (10k) split in
    ``root``, from the ``.gz`` files or their decompressed versions (names without ``.gz``)."""
    root = Path(root)
    image_file, label_file = (_find(root, name) for name in FILES[bool(train)])
    images, labels = read_idx(image_file), read_idx(label_file)
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
        raise DataError(f"{image_file}: expected images of shape [N, 28, 28], got "
                        f"{list(images.shape)}. Are the image and label files swapped?")
    if labels.dim() != 1:
        raise DataError(f"{label_file}: expected a 1-dim label file, got shape "
                        f"{list(labels.shape)}. Are the image and label files swapped?")
    if len(images) != len(labels):
        raise DataError(f"{image_file} has {len(images)} images but {label_file} has "
                        f"{len(labels)} labels; the two files come from different versions or "
                        "one is damaged. Download both again.")
    if len(labels) and int(labels.max()) > 9:
        bad = int((labels > 9).nonzero()[0, 0])
        raise DataError(f"{label_file}: label {int(labels[bad])} at index {bad} is not a digit "
                        "0-9; the file is damaged. Download it again.")
    return images, labels.to(torch.int64)


def _find(root: Path, gz_name: str) -> Path:
    for name in (gz_name, gz_name[:-len(".gz")]):
        if (root / name).is_file():
            return root / name
    raise DataError(missing_message(root, gz_name))


def missing_message(root: Path, missing: str) -> str:
    """What to do when an MNIST file is absent: where the files go, how to fetch them, and how
    to run without them."""
    where = f"{missing} is not in {root}"
    if not root.is_dir():
        where += " (it is a file, not a folder)" if root.exists() else \
            " (the folder does not exist)"
    names = ", ".join(FILES[True] + FILES[False])
    return (f"MNIST not found: {where}. Put the four official files ({names}; the names without "
            f".gz also work) in {root}, or run `kasoku data download mnist "
            f"{flag('data_download.out')} {root}` (or pass {flag('data.download')}) to fetch them "
            f"(md5-verified), or pass {flag('data.synthetic')} to train on generated data of the "
            "same shapes.")


def to_unit_float(x: torch.Tensor) -> torch.Tensor:
    """Batch transform: uint8 pixels -> float32 in ``[0, 1]`` (module-level, so it pickles)."""
    return x.to(torch.float32) / 255.0


def mnist_datasets(root: str | Path, download: bool = False) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train 60k, val 10k)`` in memory: uint8 ``[N,1,28,28]`` images stored, float32 /255
    batches out, int64 labels. ``download=True`` fetches missing files first (md5-verified)."""
    root = Path(root)
    if download:
        kasoku.data.download.fetch_dataset("mnist", root)
    datasets = []
    for train, name in ((True, "MNIST train"), (False, "MNIST test (t10k)")):
        images, labels = load_mnist(root, train)
        datasets.append(ArrayDataset(images.unsqueeze(1), labels, transform=to_unit_float,
                                     name=name))
    return datasets[0], datasets[1]
