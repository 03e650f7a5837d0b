import functools
import hashlib
import io
import os
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kasoku.core.errors import ConfigError, DataError
from kasoku.data import download
from kasoku.data.cifar10 import load_cifar10
from kasoku.data.download import DATASETS, download_file, extract_tar, fetch_dataset


class _QuietHandler(SimpleHTTPRequestHandler):
    requests = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields (base URL, folder, requests)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = type("H", (_QuietHandler,), {"requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", www, handler.requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".part")]


def test_download_over_http_and_skip_when_present(server, tmp_path):
    base, www, requests = server
    payload = np.random.default_rng(0).bytes(3 * 1024 * 1024 + 17)
    (www / "blob.bin").write_bytes(payload)
    dest = tmp_path / "data" / "blob.bin"
    assert download_file(f"{base}/blob.bin", dest, md5(payload), progress=True) == dest
    assert dest.read_bytes() == payload and leftovers(dest.parent) == []
    download_file(f"{base}/blob.bin", dest, md5(payload))
    assert len(requests) == 1  # already there with the right md5: not fetched again


def test_download_from_file_url(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello kasoku")
    dest = download_file(src.as_uri(), tmp_path / "out" / "x.bin", md5(b"hello kasoku"),
                         progress=False)
    assert dest.read_bytes() == b"hello kasoku"


def test_md5_mismatch_raises_and_leaves_nothing(server, tmp_path):
    base, www, _ = server
    (www / "f.gz").write_bytes(b"tampered")
    dest = tmp_path / "d" / "f.gz"
    wrong = "0" * 32
    with pytest.raises(DataError) as e:
        download_file(f"{base}/f.gz", dest, wrong, progress=False)
    msg = str(e.value)
    assert f"{base}/f.gz" in msg and wrong in msg and md5(b"tampered") in msg
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_wrong_existing_file_is_replaced(server, tmp_path):
    base, www, _ = server
    (www / "f").write_bytes(b"good")
    dest = tmp_path / "f"
    dest.write_bytes(b"stale partial")
    download_file(f"{base}/f", dest, md5(b"good"), progress=False)
    assert dest.read_bytes() == b"good"


def test_network_errors_say_url_and_by_hand(server, tmp_path):
    base, _, _ = server
    with pytest.raises(DataError, match="by hand") as e:
        download_file(f"{base}/missing.gz", tmp_path / "m.gz", "0" * 32, progress=False)
    assert f"{base}/missing.gz" in str(e.value) and leftovers(tmp_path) == []
    with pytest.raises(DataError, match="download failed"):  # nothing listens on port 9
        download_file("http://127.0.0.1:9/x", tmp_path / "x", "0" * 32, progress=False)


def test_fetch_mnist_real_files_from_file_url(mnist_dir, tmp_path):
    root = fetch_dataset("mnist", tmp_path / "mnist", base_url=mnist_dir.as_uri(),
                         progress=False)
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted(f for f, _, _ in DATASETS["mnist"])  # official md5s matched


def test_fetch_falls_back_to_mirror(server, tmp_path, monkeypatch):
    base, www, requests = server
    (www / "a.gz").write_bytes(b"A")
    monkeypatch.setitem(DATASETS, "tiny", [("a.gz", f"{base}/official/a.gz", md5(b"A"))])
    monkeypatch.setitem(download.MIRRORS, "tiny", [f"{base}/"])
    fetch_dataset("tiny", tmp_path / "t", progress=False)
    assert (tmp_path / "t" / "a.gz").read_bytes() == b"A"
    assert requests == ["/official/a.gz", "/a.gz"]


def _tar_gz(members: dict[str, bytes], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo("cifar-10-batches-bin/link")
            info.type, info.linkname = tarfile.SYMTYPE, symlink
            tar.addfile(info)
    return buf.getvalue()


def _record_bytes(n: int, label: int) -> bytes:
    return (bytes([label]) + bytes(3072)) * n


def test_fetch_cifar10_archive_over_http(server, tmp_path, monkeypatch):
    base, www, requests = server
    files = {f"cifar-10-batches-bin/data_batch_{i}.bin": _record_bytes(3, i) for i in range(1, 6)}
    files["cifar-10-batches-bin/test_batch.bin"] = _record_bytes(2, 0)
    archive = _tar_gz(files)
    (www / "cifar-10-binary.tar.gz").write_bytes(archive)
    official = DATASETS["cifar10"][0]
    monkeypatch.setitem(DATASETS, "cifar10", [(official[0], official[1], md5(archive))])
    root = fetch_dataset("cifar10", tmp_path / "c", base_url=base, progress=False)
    x, y = load_cifar10(root, [1, 2, 3, 4])
    assert x.shape == (12, 3, 32, 32) and y.tolist() == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    fetch_dataset("cifar10", root, base_url=base, progress=False)
    assert len(requests) == 1  # extracted files present: nothing downloaded


@pytest.mark.parametrize("evil", ["../escaped.bin", "/tmp/kasoku-abs-escape.bin", "link"])
def test_extract_refuses_members_escaping_the_folder(tmp_path, evil):
    if evil == "link":
        archive = _tar_gz({"ok.bin": b"1"}, symlink="/etc/passwd")
    else:
        archive = _tar_gz({"ok.bin": b"1", evil: b"pwned"})
    (tmp_path / "a.tar.gz").write_bytes(archive)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(DataError, match="refusing member"):
        extract_tar(tmp_path / "a.tar.gz", dest)
    assert not (tmp_path / "escaped.bin").exists() and list(dest.iterdir()) == []
    if evil.startswith("/"):
        assert not os.path.exists(evil)


def test_damaged_archive_and_unknown_dataset(tmp_path):
    (tmp_path / "a.tar.gz").write_bytes(_tar_gz({"x": b"1" * 10000})[:30])
    with pytest.raises(DataError, match="cannot extract"):
        extract_tar(tmp_path / "a.tar.gz", tmp_path)
    with pytest.raises(ConfigError, match="mnist"):
        fetch_dataset("imagenet", tmp_path)


def test_official_sources():
    md5s = {f: m for f, _, m in DATASETS["mnist"]}
    assert md5s["train-images-idx3-ubyte.gz"] == "f68b3c2dcbeaaa9fbdd348bbdeb94873"
    assert md5s["t10k-labels-idx1-ubyte.gz"] == "ec29112dd5afa0611ce80d1b7f02629c"
    assert all(u.startswith("https://yann.lecun.com/exdb/mnist/") for _, u, _ in DATASETS["mnist"])
    assert DATASETS["cifar10"] == [("cifar-10-binary.tar.gz",
                                    "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
                                    "c32a1d4ab5d03f1284b67883e8d87530")]
