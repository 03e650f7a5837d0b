import os
import random

import numpy as np
import pytest
import torch

from kasoku.train import snapshot as snap
from kasoku.train.snapshot import (
    SnapshotError,
    capture_rng_state,
    load_snapshot,
    restore_rng_state,
    save_snapshot,
)


def test_round_trip_is_weights_only(tmp_path):
    state = {"model": {"w": torch.arange(6.).reshape(2, 3)}, "n": 3, "name": "x", "f": 0.5,
             "nested": [1, (2, 3), None, True], "rng": capture_rng_state()}
    path = save_snapshot(state, tmp_path / "sub" / "snapshot_latest.pt")
    loaded = torch.load(path, weights_only=True)  # would raise on any pickled object
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["nested"] == [1, (2, 3), None, True]
    assert load_snapshot(path)["name"] == "x"
    assert os.listdir(tmp_path / "sub") == ["snapshot_latest.pt"]  # no temp file left


def crash_half_way(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04 half a snapshot")
    raise OSError("disk full")


def test_crash_while_writing_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "snapshot_latest.pt"
    save_snapshot({"iteration": 1, "w": torch.ones(3)}, path)
    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot({"iteration": 2, "w": torch.zeros(3)}, path)
    assert load_snapshot(path)["iteration"] == 1
    assert os.listdir(tmp_path) == ["snapshot_latest.pt"]


def test_failing_rename_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "snapshot_latest.pt"
    save_snapshot({"iteration": 1}, path)

    def fail(src, dst):
        raise OSError("rename failed")
    monkeypatch.setattr(snap.os, "replace", fail)
    with pytest.raises(OSError, match="rename failed"):
        save_snapshot({"iteration": 2}, path)
    monkeypatch.undo()
    assert load_snapshot(path)["iteration"] == 1
    assert os.listdir(tmp_path) == ["snapshot_latest.pt"]


def test_missing_and_corrupt_snapshots_name_the_file(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(ValueError, match="nope.pt"):
        load_snapshot(missing)
    path = tmp_path / "snapshot_latest.pt"
    save_snapshot({"w": torch.randn(100)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="snapshot_latest.pt.*unreadable"):
        load_snapshot(path)
    path.write_bytes(b"not a snapshot at all")
    with pytest.raises(ValueError, match="snapshot_latest.pt"):
        load_snapshot(path)


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": object()}, path)
    with pytest.raises(SnapshotError, match="evil.pt"):
        load_snapshot(path)


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    path = save_snapshot({"rng": capture_rng_state()}, tmp_path / "s.pt")
    expected = (torch.rand(5), np.random.normal(size=5), random.random(), random.gauss(0, 1))
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    restore_rng_state(load_snapshot(path)["rng"])
    got = (torch.rand(5), np.random.normal(size=5), random.random(), random.gauss(0, 1))
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2:] == expected[2:]


class _FakeTrainer:
    def __init__(self, out, weights):
        from types import SimpleNamespace
        self.out, self.weights = out, weights
        self.updater = SimpleNamespace(iteration=7, epoch=1)
        self.last_snapshot_iteration = None

    def state_dict(self):
        return {"w": self.weights, "iteration": self.updater.iteration}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("background", [True, False])
def test_snapshot_is_a_copy_taken_at_the_call(tmp_path, device, background):
    from kasoku.train.extensions import Snapshot
    weights = torch.ones(1 << 20, device=device)
    if device == "cuda":  # keep the stream busy, so the copy is still queued at the call's end
        x = torch.randn(4096, 4096, device=device)
        for _ in range(20):
            x = x @ x / 64
    trainer = _FakeTrainer(tmp_path, weights)
    ext = Snapshot(background=background)
    ext(trainer)
    weights.add_(5)  # training goes on in place while the file is written
    ext.finalize(trainer)
    saved = load_snapshot(tmp_path / "snapshot_latest.pt")["w"]
    assert saved.device.type == "cpu" and torch.equal(saved, torch.ones(1 << 20))
    path = ext.write_snapshot(trainer)  # an interrupt's snapshot: written before it returns
    assert torch.equal(load_snapshot(path)["w"], torch.full((1 << 20,), 6.0))


def test_background_write_failure_is_raised_at_finalize(tmp_path, monkeypatch):
    from kasoku.train.extensions import Snapshot
    trainer = _FakeTrainer(tmp_path, torch.ones(2))
    save_snapshot({"w": torch.zeros(2)}, tmp_path / "snapshot_latest.pt")
    monkeypatch.setattr(torch, "save", crash_half_way)
    ext = Snapshot(background=True)
    ext(trainer)
    with pytest.raises(OSError, match="disk full"):
        ext.finalize(trainer)
    assert torch.equal(load_snapshot(tmp_path / "snapshot_latest.pt")["w"], torch.zeros(2))


def test_old_snapshots_are_removed_only_in_the_runs_own_folder(tmp_path):
    # A run resumed into a new folder carries the names of the snapshots written before; the
    # files of the folder it came from stay.
    from kasoku.train.extensions import Snapshot
    elsewhere, here = tmp_path / "first", tmp_path / "second"
    elsewhere.mkdir()
    save_snapshot({"w": torch.zeros(2)}, elsewhere / "snap_3.pt")
    ext = Snapshot(filename="snap_{iteration}.pt", keep=1, background=False)
    ext.load_state_dict({"written": [str(elsewhere / "snap_3.pt")]})
    trainer = _FakeTrainer(here, torch.ones(2))
    ext(trainer)
    assert (elsewhere / "snap_3.pt").is_file() and (here / "snap_7.pt").is_file()
    assert ext.state_dict() == {"written": ["snap_7.pt"]}
    (here / "snap_7.pt").rename(here / "snap_3.pt")  # an older one in this folder goes
    ext.load_state_dict({"written": ["snap_3.pt"]})
    ext(trainer)
    assert not (here / "snap_3.pt").exists() and (here / "snap_7.pt").is_file()
