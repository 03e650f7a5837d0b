"""Run folders: a fresh folder per run by default, refusal of a folder holding another run,
--overwrite removing only run files, and what --resume PATH means."""
import datetime as dt

import pytest

from kasoku.core.errors import ConfigError
from kasoku.train import SnapshotError
from kasoku.train.run_dir import default_out, find_snapshot, prepare_out, resolve_run, run_files


def test_default_out_is_new_even_within_one_second(tmp_path):
    now = dt.datetime(2026, 11, 23, 9, 30, 5)
    first = default_out("mnist-mlp", tmp_path, now)
    second = default_out("mnist-mlp", tmp_path, now)
    assert first.name == "train-mnist-mlp-20261123-093005"
    assert second.name == "train-mnist-mlp-20261123-093005-2"
    assert first.is_dir() and second.is_dir()
    assert default_out("a/b:c", tmp_path, now).name.startswith("train-a-b-c-")


def test_prepare_out_refuses_a_run_and_overwrite_removes_only_run_files(tmp_path):
    out = tmp_path / "run"
    assert prepare_out(out) == out and out.is_dir()
    for name in ("log.jsonl", "snapshot_latest.pt", "loss.png", "notes.txt"):
        (out / name).write_text(name)
    with pytest.raises(ConfigError, match=f"continue it with --resume {out}"):
        prepare_out(out)
    prepare_out(out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # the user's own file stays
    (out / "log.jsonl").write_text("x")  # a log without a snapshot: nothing to resume
    with pytest.raises(ConfigError, match="holds a previous run") as refused:
        prepare_out(out)
    assert "--resume" not in str(refused.value)


def test_find_snapshot_takes_a_folder_or_a_file(tmp_path):
    (tmp_path / "snapshot_latest.pt").write_bytes(b"x")
    assert find_snapshot(tmp_path) == tmp_path / "snapshot_latest.pt"
    assert find_snapshot(tmp_path / "snapshot_latest.pt") == tmp_path / "snapshot_latest.pt"
    other = tmp_path / "other"
    other.mkdir()
    (other / "snapshot_iter_10.pt").write_bytes(b"x")
    assert find_snapshot(other) == other / "snapshot_iter_10.pt"
    (other / "snapshot_iter_10.pt").unlink()
    with pytest.raises(SnapshotError, match="holds no snapshot"):
        find_snapshot(other)
    with pytest.raises(SnapshotError, match="no such file or folder"):
        find_snapshot(tmp_path / "missing")


def test_resolve_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, snap = resolve_run("w", None, None, False)  # a new folder under runs/
    assert out.parent.name == "runs" and out.is_dir() and snap is None
    run = tmp_path / "run"
    assert resolve_run("w", run, "auto", False) == (run, None)  # nothing yet: fresh
    (run / "snapshot_latest.pt").write_bytes(b"x")
    assert resolve_run("w", run, "auto", False) == (run, run / "snapshot_latest.pt")
    assert resolve_run("w", None, run, False) == (run, run / "snapshot_latest.pt")
    fork = tmp_path / "fork"  # a resume into a new folder continues the run there
    assert resolve_run("w", fork, run, False) == (fork, run / "snapshot_latest.pt")
    assert run_files(fork) == []
    with pytest.raises(ConfigError, match="give --out DIR"):
        resolve_run("w", None, "auto", False)


def test_build_trainer_passes_overwrite_on(tmp_path):
    from kasoku.commands.train import build_trainer
    from kasoku.data.config import DataConfig
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload
    data = DataConfig(synthetic_train_size=100, synthetic_val_size=20)

    def trainer(**kw):
        return build_trainer(create_workload("sine-lstm"), data,
                             TrainConfig(epochs=1, batch_size=50, out=tmp_path, progress=False,
                                         **kw))

    trainer().run()
    with pytest.raises(ConfigError, match="holds a previous run"):
        trainer().run()
    trainer(overwrite=True).run()


def test_saved_line_names_the_runs_files(tmp_path):
    from kasoku.train.run_dir import saved_line
    for name in ("log.jsonl", "loss.png", "accuracy.png", "snapshot_latest.pt", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert saved_line(tmp_path) == (f"saved in {tmp_path}: log log.jsonl; plots accuracy.png, "
                                    "loss.png; snapshot snapshot_latest.pt")


def test_the_new_folders_left_empty_are_removed_and_no_other(tmp_path):
    from kasoku.train.run_dir import default_out, remove_empty_made
    empty, kept = default_out("a", root=tmp_path), default_out("b", root=tmp_path)
    (kept / "profile.json").write_text("{}")
    given = tmp_path / "given"
    given.mkdir()  # a folder kasoku did not make stays, empty or not
    remove_empty_made()
    assert not empty.exists() and (kept / "profile.json").is_file() and given.is_dir()
