"""Fetch the public datasets from their official URLs, md5-verified and written atomically.

A download streams into a temporary file beside its destination and is renamed onto it only
after the md5 matches, so an interrupted or corrupted download never leaves a file that looks
complete. Archives are extracted with members confined to the target folder.
"""
from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from kasoku.core.errors import ConfigError, DataError
from kasoku.core.status_line import StatusLine

_MNIST = "https://yann.lecun.com/exdb/mnist/"
DATASETS = {
    "mnist": [
        ("train-images-idx3-ubyte.gz", _MNIST + "train-images-idx3-ubyte.gz",
         "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        ("train-labels-idx1-ubyte.gz", _MNIST + "train-labels-idx1-ubyte.gz",
         "d53e105ee54ea40749a09fcbcd1e9432"),
        ("t10k-images-idx3-ubyte.gz", _MNIST + "t10k-images-idx3-ubyte.gz",
         "9fb629c4189551a2d022fa330f9573f3"),
        ("t10k-labels-idx1-ubyte.gz", _MNIST + "t10k-labels-idx1-ubyte.gz",
         "ec29112dd5afa0611ce80d1b7f02629c"),
    ],
    "cifar10": [
        ("cifar-10-binary.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
         "c32a1d4ab5d03f1284b67883e8d87530"),
    ],
}
"""name -> [(file name, official URL, md5)]."""
MIRRORS = {"mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/"]}
"""name -> base URLs tried, in order, when the official URL fails (same file names and md5)."""
EXTRACTED = {"cifar10": [f"cifar-10-batches-bin/data_batch_{i}.bin" for i in range(1, 6)]
                        + ["cifar-10-batches-bin/test_batch.bin"]}
"""name -> files an archive yields; when all exist, nothing is downloaded."""

_CHUNK_BYTES = 1 << 20
_TIMEOUT_S = 60


def md5_of(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def download_file(url: str, dest: Path, md5: str, progress: bool = True) -> Path:
    """Download ``url`` to ``dest`` and return ``dest``; skipped when ``dest`` already has
    ``md5``. Streams into a temporary file in ``dest``'s folder, checks the md5, then renames
    it onto ``dest``. A network error or md5 mismatch raises ``DataError`` and leaves no file."""
    dest = Path(dest)
    if dest.is_file() and md5_of(dest) == md5:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            actual, received, total = _stream(url, out, dest.name, progress)
        if total is not None and received != total:
            raise DataError(f"{url}: the connection closed after {received} of {total} bytes. "
                            f"Try again, or download the file by hand into {dest.parent}.")
        if actual != md5:
            raise DataError(f"{url}: md5 {actual} does not match the expected {md5}; the "
                            "download is corrupt or the file has changed. Try again or use a "
                            f"mirror, and put the file by hand into {dest.parent}.")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _stream(url: str, out, label: str, progress: bool) -> tuple[str, int, int | None]:
    """Copy ``url`` into ``out``; returns (md5 hex, bytes received, Content-Length or None)."""
    h, received = hashlib.md5(), 0
    line = StatusLine() if progress else None
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            while chunk := response.read(_CHUNK_BYTES):
                out.write(chunk)
                h.update(chunk)
                received += len(chunk)
                if line:
                    line.update(_progress(label, received, total))
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(f"{url}: download failed ({e}). Check the network, or download the "
                        "file by hand with a browser and put it into the dataset folder.") from e
    finally:
        if line:
            line.close()
    return h.hexdigest(), received, total


def _progress(label: str, received: int, total: int | None) -> str:
    of = f" / {total / 1e6:.1f} MB" if total else " MB"
    return f"{label}: {received / 1e6:.1f}{of}"


def fetch_dataset(name: str, root: str | Path, base_url: str | None = None,
                  progress: bool = True) -> Path:
    """Download dataset ``name`` ("mnist" or "cifar10") into ``root`` and return ``root``.

    Files already present with the right md5 are kept. ``base_url`` replaces the official
    location (file names stay the same), e.g. a local mirror or ``file://`` folder. CIFAR-10's
    archive is extracted into ``root`` (``root/cifar-10-batches-bin``).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; downloadable: {', '.join(DATASETS)}")
    root = Path(root)
    if name in EXTRACTED and all((root / f).is_file() for f in EXTRACTED[name]):
        return root
    for filename, url, md5 in DATASETS[name]:
        bases = [base_url] if base_url else [url[: -len(filename)]] + MIRRORS.get(name, [])
        dest = _download_first(bases, filename, root / filename, md5, progress)
        if filename.endswith((".tar.gz", ".tgz", ".tar")):
            extract_tar(dest, root)
    return root


def _download_first(bases: list[str], filename: str, dest: Path, md5: str,
                    progress: bool) -> Path:
    errors = []
    for base in bases:
        url = base.rstrip("/") + "/" + filename
        try:
            return download_file(url, dest, md5, progress)
        except DataError as e:
            errors.append(str(e))
    raise DataError(f"could not download {filename} from any source:\n  " + "\n  ".join(errors)
                    + f"\nDownload it by hand (md5 {md5}) and put it into {dest.parent}.")


def extract_tar(archive: Path, dest: Path) -> None:
    """Extract ``archive`` into ``dest``, refusing members that would land outside ``dest``
    (absolute paths, ``..``, links, devices) with ``DataError``."""
    dest = Path(dest).resolve()
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                target = (dest / m.name).resolve()
                if not (m.isfile() or m.isdir()) or not target.is_relative_to(dest):
                    raise DataError(f"{archive}: refusing member {m.name!r}: it is a link, a "
                                    f"device or escapes {dest}. The archive is not the "
                                    "official one; delete it and download again.")
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.10.12: defence in depth
                tar.extractall(dest, members=members, filter="data")
            else:
                tar.extractall(dest, members=members)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive}: cannot extract ({e}); the archive is damaged. Delete it "
                        "and download again.") from e
