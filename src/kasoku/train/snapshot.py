"""Snapshot files: written atomically, read with ``torch.load(weights_only=True)``.

A snapshot holds only tensors and plain containers (dict, list, tuple, str, int, float, bool,
None), so loading one never runs pickled code. RNG states are converted to that form here.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from kasoku.core.errors import KasokuWarning
from kasoku.core.flags import flag
from kasoku.core.snapshot_names import TRAINER_FILE, is_sharded_snapshot
from kasoku.distributed import ddp
from kasoku.distributed.fsdp import MODEL_KEYS, save_sharded
from kasoku.train.run_dir import SnapshotError


def save_snapshot(state: dict, path) -> Path:
    """Write ``state`` to ``path`` so that a crash at any moment leaves either the previous
    file or the new one, never a torn one: the bytes go to a temporary file in the same folder
    (same file system, so the rename is atomic), are fsynced, then renamed over ``path``, and
    the folder is fsynced so the rename itself survives a power loss."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)
    return path


def remove_snapshot(path) -> None:
    """Delete a snapshot: a file, or a sharded snapshot's folder; gone already is fine."""
    path = Path(path)
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def save_sharded_snapshot(state: dict, folder, writer: bool) -> Path:
    """Write a trainer's ``state`` whose model and optimizer are sharded (``fsdp.state``) as
    the folder ``folder``: every worker its shards through ``torch.distributed.checkpoint``,
    the writer (worker 0) the rest as ``TRAINER_FILE``. A collective: every worker calls it.
    Atomic as ``save_snapshot``: written as a temporary folder beside it, renamed once
    complete (a crash leaves the previous snapshots and a ``.tmp`` folder, never a torn
    ``folder``)."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if writer and tmp.exists():
        shutil.rmtree(tmp)  # a crashed attempt's, at the same iteration
    ddp.broadcast_object(None)  # a barrier: no worker writes into it before it is cleared
    try:
        save_sharded({k: state[k] for k in MODEL_KEYS}, tmp)
        if writer:
            save_snapshot({k: v for k, v in state.items() if k not in MODEL_KEYS},
                          tmp / TRAINER_FILE)
    except BaseException:
        if writer:  # a failed write's shards are not left behind (a kill still leaves them)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if writer:
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)
    return folder


def load_snapshot(path, map_location="cpu") -> dict:
    """Read a snapshot written by ``save_snapshot``, or a sharded one's folder
    (``save_sharded_snapshot``): then its trainer state, without the model and optimizer,
    whose folder ``state["sharded"]`` names (``kasoku.distributed.fsdp.load_sharded`` reads
    them). Raises ``SnapshotError`` (a ValueError) naming the file when it is missing or
    unreadable."""
    path = Path(path)
    if is_sharded_snapshot(path):
        return dict(load_snapshot(path / TRAINER_FILE, map_location), sharded=str(path))
    if not path.is_file():
        raise SnapshotError(f"no snapshot at {path}; give the path of a snapshot_*.pt file "
                            f"written by a previous run, or train without {flag('train.resume')}")
    kind = _not_a_snapshot(path)
    if kind:
        raise SnapshotError(f"{flag('train.resume')} {path} is not a kasoku snapshot (a "
                            f"snapshot_*.pt file a run wrote, a zip archive) but {kind}; give "
                            f"a run folder or one of its snapshot_*.pt files")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = first.split(". ")[0]  # torch's explanations run on for paragraphs
        raise SnapshotError(f"snapshot {path} is unreadable ({type(exc).__name__}: {first}); "
                            f"it is truncated or not a kasoku snapshot: resume from another "
                            f"one") from exc
    if not isinstance(state, dict):
        raise SnapshotError(f"snapshot {path} holds a {type(state).__name__}, not a state dict")
    return state


def _not_a_snapshot(path: Path) -> str:
    """What ``path`` is when its first bytes show it is no file ``torch.save`` wrote (a zip
    archive, or the legacy pickle): ``an empty file``, ``a text file``, ``a file of another
    kind``; "" when it may be one (its reading then says what is wrong)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return ""
    if not head:
        return "an empty file"
    if head.startswith(b"PK") or head[:1] == b"\x80":
        return ""
    text = head.decode("utf-8", errors="replace")[:-3]  # the last character may be cut
    return "a text file" if all(c.isprintable() or c in "\n\r\t" for c in text) \
        else "a file of another kind"


def fsync_dir(folder) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and Windows) refuse fsync on a directory
    finally:
        os.close(fd)


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def capture_rng_state() -> dict:
    """The global RNG states (torch CPU, every CUDA device, numpy, python) in weights_only-safe
    form."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda,
            "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                      "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                      "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss}}


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``."""
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            warnings.warn(f"snapshot has RNG states of {len(cuda)} CUDA devices, this machine "
                          f"{count}: restoring the first {min(count, len(cuda))}; "
                          f"the resumed run may not be bit-identical", KasokuWarning,
                          stacklevel=2)
        for i, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s.cpu(), i)
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
