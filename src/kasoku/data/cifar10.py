"""CIFAR-10 from the binary (``cifar-10-batches-bin``) or python (``cifar-10-batches-py``)
version, held in memory as uint8 and normalized a batch at a time.

The project's protocol trains on ``data_batch_1..4`` and validates on ``data_batch_5`` (never
trained on), reported as "CIFAR-10 holdout (batch 5)", never as test accuracy.
"""
from __future__ import annotations

import codecs
import os
import pickle
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

import kasoku.data.download
from kasoku.core.errors import ConfigError, DataError
from kasoku.core.flags import flag
from kasoku.data.base import ArrayDataset
from kasoku.data.transforms import CIFAR10_MEAN, CIFAR10_STD, ToUnitFloat, random_crop_flip

RECORD_BYTES = 1 + 3 * 32 * 32
HOLDOUT_NAME = "CIFAR-10 holdout (batch 5)"


def read_cifar_bin(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 [N,3,32,32], labels int64 [N])`` of a binary-version batch file
    (records of 1 label byte + 3072 pixel bytes, R, G, B planes)."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    if size == 0 or size % RECORD_BYTES:
        raise DataError(f"{path}: size {size} bytes is not a positive multiple of the "
                        f"{RECORD_BYTES}-byte CIFAR-10 record (1 label + 3072 pixels); the file "
                        "is truncated or not a CIFAR-10 binary batch. Download it again.")
    records = np.fromfile(path, dtype=np.uint8).reshape(-1, RECORD_BYTES)
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    images = torch.from_numpy(np.ascontiguousarray(records[:, 1:])).view(-1, 3, 32, 32)
    _check_labels(path, labels)
    return images, labels


def _check_labels(path: Path, labels: torch.Tensor) -> None:
    if len(labels) and (int(labels.max()) > 9 or int(labels.min()) < 0):
        bad = int(((labels > 9) | (labels < 0)).nonzero()[0, 0])
        raise DataError(f"{path}: label {int(labels[bad])} of record {bad} is not a class 0-9; "
                        "the file is damaged or not CIFAR-10 (CIFAR-100 has 2 label bytes). "
                        "Download it again.")


def _numpy_reconstruct():
    try:  # numpy >= 2 moved the implementation; both names appear in pickles in the wild
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class _CifarUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled numpy array needs; anything else (``os.system``,
    ``builtins.eval``, ...) is refused before it can be called."""

    def __init__(self, file, path: Path):
        super().__init__(file, encoding="bytes")  # the official files are Python 2 pickles
        self.path = path
        reconstruct = _numpy_reconstruct()
        self.allowed = {
            ("numpy.core.multiarray", "_reconstruct"): reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): reconstruct,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            # Python 3 writes bytes as _codecs.encode(str, "latin1") under protocol 2.
            ("_codecs", "encode"): codecs.encode,
        }

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise DataError(f"{self.path}: refused to load global {module}.{name}: a CIFAR-10 "
                            "python batch only holds numpy arrays and lists, so this file is not "
                            "one (and may be hostile). Use the official files, or the binary "
                            "version.") from None


def read_cifar_pickle(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images uint8 [N,3,32,32], labels int64 [N])`` of a python-version batch file (a
    pickled dict with ``data`` uint8 ``(N, 3072)`` and ``labels``), read with an unpickler that
    can only rebuild numpy arrays, so a hostile file cannot run code."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, path).load()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise DataError(f"{path}: not a readable CIFAR-10 python batch ({type(e).__name__}: "
                        f"{e}). Download it again.") from e
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    data, labels = _get(obj, "data", path), _get(obj, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != RECORD_BYTES - 1:
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' should be a uint8 array of shape (N, 3072), got {what}")
    try:
        labels_t = torch.as_tensor(np.asarray(labels, dtype=np.int64)).reshape(-1)
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: 'labels' is not a list of integers ({e})") from e
    if len(labels_t) != len(data):
        raise DataError(f"{path}: {len(data)} images but {len(labels_t)} labels")
    _check_labels(path, labels_t)
    images = torch.from_numpy(np.ascontiguousarray(data)).view(-1, 3, 32, 32)
    return images, labels_t


def _get(obj: dict, key: str, path: Path):
    for k in (key.encode(), key):  # Python 2 str keys arrive as bytes under encoding="bytes"
        if k in obj:
            return obj[k]
    raise DataError(f"{path}: no {key!r} entry (keys: {sorted(map(str, obj))}); not a CIFAR-10 "
                    "python batch. Download it again.")


def _batch_names(batch) -> tuple[str, str]:
    """(binary name, python name) of batch 1..5 or "test"."""
    if batch == "test":
        return "test_batch.bin", "test_batch"
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) \
            or not 1 <= int(batch) <= 5:
        raise ConfigError(f"CIFAR-10 batch {batch!r} does not exist: use 1-5 or 'test'")
    return f"data_batch_{int(batch)}.bin", f"data_batch_{int(batch)}"


def _find_batch(root: Path, batch) -> Path:
    bin_name, py_name = _batch_names(batch)
    candidates = [root / "cifar-10-batches-bin" / bin_name, root / bin_name,
                  root / "cifar-10-batches-py" / py_name, root / py_name]
    for c in candidates:
        if c.is_file():
            return c
    absent = "" if root.is_dir() else " (it is a file, not a folder)" if root.exists() \
        else " (the folder does not exist)"
    raise DataError(f"CIFAR-10 not found: no {bin_name} in {root}/cifar-10-batches-bin or in "
                    f"{root}{absent}, and no python-version {py_name} in "
                    f"{root}/cifar-10-batches-py either. Extract cifar-10-binary.tar.gz into "
                    f"{root} (it makes cifar-10-batches-bin/data_batch_1.bin ... _5.bin), or run "
                    f"`kasoku data download cifar10 {flag('data_download.out')} {root}` (or pass "
                    f"{flag('data.download')}) to fetch it (md5-verified), or pass "
                    f"{flag('data.synthetic')} to train on generated data of the same shapes.")


def load_cifar10(root: str | Path, batches: Iterable) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated ``(images uint8 [N,3,32,32], labels int64 [N])`` of ``batches`` (1-5 or
    "test"), each from the binary version if present, else the python version."""
    root = Path(root)
    paths = [_find_batch(root, b) for b in batches]
    if not paths:
        raise ConfigError("load_cifar10 needs at least one batch (1-5 or 'test')")
    parts = [read_cifar_pickle(p) if p.suffix != ".bin" else read_cifar_bin(p) for p in paths]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class AugmentedArrayDataset(ArrayDataset):
    """An ``ArrayDataset`` of uint8 ``[N,C,H,W]`` images whose batches get a random crop
    (reflect padding ``pad``) and horizontal flip before ``transform``; each sample's choice
    depends only on ``(seed, epoch, index)``, so it is the same in any process and after a
    resume. Call ``set_epoch`` at the start of every epoch."""

    def __init__(self, inputs, targets, transform=None, name="array", seed: int = 0,
                 pad: int = 4):
        super().__init__(inputs, targets, transform=transform, name=name)
        if inputs.dim() != 4 or not 0 <= pad < min(inputs.shape[-2:]):
            raise ValueError(f"{name}: crop+flip needs [N,C,H,W] images and 0 <= pad < H, W; got "
                             f"shape {list(inputs.shape)} and pad={pad}")
        self.seed, self.pad, self.epoch = int(seed), int(pad), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def get_batch(self, indices: torch.Tensor):
        indices = torch.as_tensor(indices, dtype=torch.int64)
        x = random_crop_flip(self.inputs[indices], self.seed, self.epoch, indices, self.pad)
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[indices]


def _describe(batches: Sequence) -> str:
    if tuple(batches) == (5,):
        return HOLDOUT_NAME
    return "CIFAR-10 batches " + ",".join(map(str, batches))


def cifar10_datasets(root: str | Path, train_batches: Sequence = (1, 2, 3, 4),
                     val_batches: Sequence = (5,), augment: bool = False, seed: int = 0,
                     download: bool = False) -> tuple[ArrayDataset, ArrayDataset | None]:
    """``(train, val)``: uint8 in memory, float32 batches normalized with the CIFAR-10
    per-channel mean/std, int64 labels. ``augment`` gives the train set crop+flip keyed on
    ``(seed, epoch, index)``. ``val`` is None when ``val_batches`` is empty. Overlapping
    train and val batches raise ``ConfigError``: that would validate on trained data."""
    root = Path(root)
    train_batches, val_batches = tuple(train_batches), tuple(val_batches)
    overlap = set(train_batches) & set(val_batches)
    if overlap:
        raise ConfigError(f"CIFAR-10 batches {sorted(map(str, overlap))} are in both the train "
                          "and val sets; validation must use data never trained on (the default "
                          "is train 1-4, val 5).")
    if download:
        kasoku.data.download.fetch_dataset("cifar10", root)
    normalize = ToUnitFloat(CIFAR10_MEAN, CIFAR10_STD)
    images, labels = load_cifar10(root, train_batches)
    train_name = f"CIFAR-10 train (batches {','.join(map(str, train_batches))})"
    if augment:
        train = AugmentedArrayDataset(images, labels, normalize, train_name, seed=seed)
    else:
        train = ArrayDataset(images, labels, transform=normalize, name=train_name)
    val = None
    if val_batches:
        images, labels = load_cifar10(root, val_batches)
        val = ArrayDataset(images, labels, transform=normalize, name=_describe(val_batches))
    return train, val
