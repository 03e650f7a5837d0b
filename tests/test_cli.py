"""The command line end to end: real processes where signals and exit codes matter; run
folders that never lose work; one-line errors and warnings."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from kasoku import __version__
from kasoku.cli import main
from kasoku.train import load_snapshot
from kasoku.workloads import list_workloads

SINE = ["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50", "--no-progress",
        "--threads", "1"]


def one_line(err: str) -> str:
    """The one line a mistake prints (a run that started says first where it writes)."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("# ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_list_shows_every_workload_and_loader(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in [*list_workloads(), "multiprocess[:N]", "gpu-jpeg[:N]"]:
        assert name in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kasoku {__version__}"


def test_missing_dataset_is_a_clear_error_and_leaves_no_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "mnist-mlp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # the error alone: no run was started, so no run is named
    assert "--data" in err and "--synthetic" in err and "kasoku data download mnist" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert main(["train", "mnist-mlp", "--data", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_bad_settings_are_clear_errors(capsys, tmp_path):
    assert main(["train", "sine-lstm", "--device", "cuda:7", "--out", str(tmp_path / "a")]) == 2
    assert "cuda:7" in one_line(capsys.readouterr().err)
    assert main(["train", "sine-lstm", "--resume", str(tmp_path / "missing.pt")]) == 2
    assert "no such file or folder" in one_line(capsys.readouterr().err)
    assert main(["train", "no-such-workload"]) == 2
    assert "kasoku list" in one_line(capsys.readouterr().err)
    (tmp_path / "bad.pt").write_bytes(b"not a snapshot")
    assert main(["train", "sine-lstm", "--resume", str(tmp_path / "bad.pt")]) == 2
    assert "bad.pt" in one_line(capsys.readouterr().err)
    (tmp_path / "notes.txt").write_text("epoch 1: loss 2.3\n")
    line = one_line(capsys.readouterr().err if main(
        ["train", "sine-lstm", "--resume", str(tmp_path / "notes.txt")]) == 2 else "")
    assert line == (f"kasoku: error: --resume {tmp_path / 'notes.txt'} is not a kasoku "
                    "snapshot (a snapshot_*.pt file a run wrote, a zip archive) but a text "
                    "file; give a run folder or one of its snapshot_*.pt files")


def _weights(path):
    return load_snapshot(path)["model"]


def test_train_writes_log_plots_and_snapshot_and_resumes_exactly(tmp_path, capsys):
    args = [*SINE, "--seed", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(args + ["--epochs", "2", "--out", str(straight)]) == 0
    captured = capsys.readouterr()
    assert captured.out.split("\n")[0].split() == ["epoch", "main/loss",
                                                   "validation/main/loss", "elapsed_time"]
    assert captured.err.splitlines()[0].startswith("# sine-lstm") and str(straight) in \
        captured.err.splitlines()[0]
    log = [json.loads(line) for line in open(straight / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2]
    assert log[1]["main/loss"] < log[0]["main/loss"]
    assert (straight / "loss.png").stat().st_size > 1000
    assert captured.err.splitlines()[-1] == (f"saved in {straight}: log log.jsonl; plots "
                                             "loss.png; snapshot snapshot_latest.pt")

    assert main(args + ["--epochs", "1", "--out", str(split)]) == 0
    capsys.readouterr()
    assert main(args + ["--epochs", "2", "--resume", str(split)]) == 0  # the folder
    err = capsys.readouterr().err
    assert f"resumed from {split / 'snapshot_latest.pt'} at epoch 1, iteration 4" in err
    a, b = _weights(straight / "snapshot_latest.pt"), _weights(split / "snapshot_latest.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["epoch"] for line in open(split / "log.jsonl")] == [1, 2]


def test_the_same_command_twice_keeps_both_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    command = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "200", "--epochs",
               "1", "--no-progress", "--threads", "1"]
    assert main(command) == 0 and main(command) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("train-mnist-mlp-") for r in runs)
    for run in runs:
        assert (run / "snapshot_latest.pt").is_file() and (run / "log.jsonl").stat().st_size
    firsts = [line for line in capsys.readouterr().err.splitlines() if line.startswith("#")]
    assert [f"out: runs/{r.name}" in line for r, line in zip(runs, firsts)] == [True, True]


def test_a_folder_holding_a_run_is_refused_then_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*SINE, "--epochs", "1", "--out", str(out)]) == 0
    before = (out / "log.jsonl").read_bytes(), (out / "snapshot_latest.pt").read_bytes()
    capsys.readouterr()
    # A second run, even one that would fail at once (--lr inf), leaves the first intact.
    for extra in (["--epochs", "2"], ["--lr", "inf"], ["--lr", "1e30"]):
        assert main([*SINE, *extra, "--out", str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert ("holds a previous run" in line and f"--resume {out}" in line
                and "--overwrite" in line) or "--lr" in line
        assert ((out / "log.jsonl").read_bytes(), (out / "snapshot_latest.pt").read_bytes()) \
            == before
    assert main([*SINE, "--epochs", "1", "--out", str(out), "--overwrite", "--seed", "1"]) == 0
    assert (out / "snapshot_latest.pt").read_bytes() != before[1]


def test_resume_auto_starts_fresh_then_resumes(tmp_path, capsys):
    out = tmp_path / "auto"
    assert main([*SINE, "--epochs", "1", "--out", str(out), "--resume", "auto"]) == 0
    assert "resumed from" not in capsys.readouterr().err
    assert main([*SINE, "--epochs", "2", "--out", str(out), "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert [json.loads(line)["epoch"] for line in open(out / "log.jsonl")] == [1, 2]
    assert main([*SINE, "--resume", "auto"]) == 2
    assert "give --out DIR" in one_line(capsys.readouterr().err)


def test_a_snapshot_of_another_run_is_refused_naming_both(tmp_path, capsys):
    out = tmp_path / "sine"
    assert main([*SINE, "--epochs", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    other = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "200", "--no-progress"]
    assert main([*other, "--resume", str(out), "--out", str(tmp_path / "m")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "'sine-lstm' there, 'mnist-mlp' here" in line
    args = [a if a != "50" else "25" for a in SINE]  # batch size 25 instead of 50
    assert main([*args, "--epochs", "2", "--resume", str(out)]) == 2
    assert "batch_size 50 there, 25 here" in one_line(capsys.readouterr().err)


def test_divergence_ends_in_one_line_and_leaves_log_and_snapshot_agreeing(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "400", "--batch-size",
            "40", "--no-progress", "--threads", "1", "--out", str(out)]
    assert main([*base, "--epochs", "1"]) == 0
    capsys.readouterr()
    # The resumed run logs every 2 iterations, diverges, and is stopped at a log line.
    code = main([*base[:-2], "--epochs", "3", "--lr", "1e30", "--log-interval", "2",
                 "--resume", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "--lr 1e+30 replaces the snapshot's learning rate 0.001 from iteration 10" in err
    lines = [line for line in err.splitlines() if line.startswith("kasoku: error")]
    assert len(lines) == 1 and "training diverged; lower the learning rate" in lines[0]
    assert "Traceback" not in err and "failed" not in err
    snapshot = load_snapshot(out / "snapshot_latest.pt")
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert log[-1]["iteration"] == snapshot["updater"]["iteration"] == 10
    failed = out / "log.failed.jsonl"  # the lines logged after the snapshot, if any
    assert not failed.exists() or all(json.loads(line)["iteration"] > 10
                                      for line in open(failed))


def test_out_that_cannot_hold_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main([*SINE, "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in one_line(capsys.readouterr().err)
    assert main([*SINE, "--out", "/proc/kasoku/run"]) == 2
    assert "cannot create the folder" in one_line(capsys.readouterr().err)


def test_a_bad_image_with_strict_data_is_one_line(tmp_path, capsys):
    folder = tmp_path / "jpegs"
    assert main(["data", "make-jpeg", "--out", str(folder), "--count", "4", "--classes", "2",
                 "--resolution", "64x48", "--workers", "1"]) == 0
    capsys.readouterr()
    (folder / "class_000" / "img_000000.jpg").write_bytes(b"")
    assert main(["train", "imagenet-resnet50", "--data", str(folder), "--device", "cpu",
                 "--epochs", "1", "--batch-size", "2", "--strict-data", "--no-progress",
                 "--out", str(tmp_path / "r")]) == 2
    assert "img_000000.jpg" in one_line(capsys.readouterr().err)


def test_warnings_are_one_line_without_source(tmp_path, capsys):
    assert main([*SINE, "--epochs", "1", "--data", str(tmp_path), "--out",
                 str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("kasoku: warning")]
    assert warned == [f"kasoku: warning: sine-lstm generates its data; --data {tmp_path} is "
                      f"ignored"]
    assert ".py:" not in err
    assert err.splitlines()[0].startswith("# sine-lstm")  # the run is named first


def test_sigint_writes_snapshot_exits_130_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "kasoku", "train", "mnist-mlp", "--synthetic",
           "--synthetic-size", "2000", "--epochs", "200", "--out", str(out), "--no-progress",
           "--log-interval", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "log.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "to continue this run: kasoku train mnist-mlp --synthetic" in err
    assert err.rstrip().endswith(f"--resume {out}")
    state = load_snapshot(out / "snapshot_latest.pt")
    stopped_at = state["updater"]["iteration"]
    assert stopped_at > 0
    done = subprocess.run(cmd[:8] + ["--epochs", str(stopped_at / 20 + 1), "--no-progress",
                                     "--resume", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"iteration {stopped_at}" in done.stderr
    assert load_snapshot(out / "snapshot_latest.pt")["updater"]["iteration"] > stopped_at


def test_make_jpeg_then_train_resnet50_on_the_folder(tmp_path, capsys):
    folder = tmp_path / "jpegs"
    assert main(["data", "make-jpeg", "--out", str(folder), "--count", "4", "--classes", "2",
                 "--resolution", "96x72"]) == 0
    assert len(list(folder.glob("class_*/*.jpg"))) == 4
    torch.set_num_threads(2)
    assert main(["train", "imagenet-resnet50", "--data", str(folder), "--epochs", "1",
                 "--batch-size", "2", "--out", str(tmp_path / "r50"), "--no-progress",
                 "--device", "cpu"]) == 0
    log = [json.loads(line) for line in open(tmp_path / "r50" / "log.jsonl")]
    assert log[-1]["iteration"] == 2 and "main/loss" in log[-1]


def test_device_loader_trains_the_same_weights_as_serial(tmp_path):
    args = [*SINE, "--epochs", "1"]
    assert main(args + ["--out", str(tmp_path / "s")]) == 0
    assert main(args + ["--out", str(tmp_path / "d"), "--loader", "device"]) == 0
    a = _weights(tmp_path / "s" / "snapshot_latest.pt")
    b = _weights(tmp_path / "d" / "snapshot_latest.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_with_prefetch(tmp_path, capsys):
    args = [*SINE, "--epochs", "1"]
    assert main(args + ["--out", str(tmp_path / "t"), "--loader", "threads:2",
                        "--prefetch", "4"]) == 0
    assert main(args + ["--out", str(tmp_path / "s"), "--prefetch", "4"]) == 2
    assert "the serial loader makes each batch when it is asked" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before anything ran: no folder left


def test_progress_counts_the_samples_in_each_batch(tmp_path, capsys):
    # A batch larger than the dataset holds the dataset: 200 samples per step, not 10,000.
    assert main(["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "10000",
                 "--epochs", "40", "--threads", "1", "--out", str(tmp_path / "r")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines()
             if "samples/s" in line and "it/s" in line]
    assert lines
    for line in lines:
        its = float(line.split("it/s")[0].split()[-1])
        samples = float(line.split("samples/s")[0].split()[-1].replace(",", ""))
        assert samples == pytest.approx(200 * its, rel=0.02)


def test_a_run_resumed_into_a_new_folder_leaves_the_old_one_whole(tmp_path, capsys):
    first, branch = tmp_path / "first", tmp_path / "branch"
    assert main([*SINE, "--epochs", "1", "--out", str(first)]) == 0
    before = (first / "snapshot_latest.pt").read_bytes()
    assert main([*SINE, "--epochs", "2", "--resume", str(first), "--out", str(branch)]) == 0
    assert (first / "snapshot_latest.pt").read_bytes() == before
    assert load_snapshot(branch / "snapshot_latest.pt")["updater"]["iteration"] == 8
    assert main([*SINE, "--epochs", "2", "--resume", str(first), "--out",
                 str(tmp_path / "again")]) == 0  # the source still resumes


def test_a_run_that_ends_between_epochs_logs_and_snapshots_its_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*SINE, "--epochs", "1.5", "--out", str(out)]) == 0  # 4 batches an epoch
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [(e["iteration"], e.get("final", False)) for e in log] == [(4, False), (6, True)]
    assert load_snapshot(out / "snapshot_latest.pt")["updater"]["iteration"] == 6
    assert "1.5" in capsys.readouterr().out.splitlines()[-1]  # the table's last row
    assert main([*SINE, "--epochs", "2", "--resume", str(out)]) == 0
    assert "at epoch 1.5, iteration 6" in capsys.readouterr().err
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [(e["iteration"], e.get("final", False)) for e in log] == [(4, False), (8, False)]


def test_settings_that_would_be_ignored_are_said_once(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "mnist-mlp", "--synthetic", "--synthetic-size", "100", "--data",
                 str(tmp_path), "--batch-size", "500", "--epochs", "1", "--no-progress",
                 "--threads", "1", "--seed", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"kasoku: warning: --synthetic: the data in --data {tmp_path} is not read" in err
    assert "kasoku: warning: batch size 500 is larger than the 100 training samples" in err
    assert main(["train", "mnist-mlp", "--synthetic", "--synthetic-size", "100", "--batch-size",
                 "500", "--epochs", "2", "--no-progress", "--threads", "1", "--seed", "5",
                 "--resume", str(out)]) == 0
    assert "--seed 5 is not used: a resumed run keeps its snapshot's seed (4)" in \
        capsys.readouterr().err


def test_a_run_diverging_after_its_last_log_line_keeps_its_good_snapshot(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "400", "--batch-size",
            "40", "--no-progress", "--threads", "1"]
    assert main([*base, "--epochs", "1", "--out", str(out)]) == 0
    good = (out / "snapshot_latest.pt").read_bytes()
    # Ends at epoch 1.5, between log lines: the last iteration's check stops it.
    assert main([*base, "--epochs", "1.5", "--lr", "1e38", "--resume", str(out)]) == 1
    err = capsys.readouterr().err
    assert "training diverged" in err and "Traceback" not in err
    assert (out / "snapshot_latest.pt").read_bytes() == good
    lines = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [e["iteration"] for e in lines] == [10]


def test_a_mistake_found_while_building_after_a_warning_is_said_once(tmp_path):
    # A warning recorded while building (the skipped graph), then a refused snapshot.
    out = tmp_path / "run"
    base = [sys.executable, "-m", "kasoku", "train", "mnist-mlp", "--synthetic",
            "--synthetic-size", "400", "--no-progress", "--device", "cpu"]
    subprocess.run([*base, "--batch-size", "40", "--epochs", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    done = subprocess.run([*base, "--batch-size", "80", "--cuda-graph", "--resume", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kasoku: warning: cuda_graph: CUDA graphs need a CUDA device; the step runs eagerly "
        "on cpu",
        f"kasoku: error: {out / 'snapshot_latest.pt'} belongs to another run (batch_size 40 "
        f"there, 80 here); resume with that run's settings, or start a new run without "
        f"--resume"]


def test_a_resume_builds_the_data_of_its_snapshots_seed(tmp_path, capsys):
    args = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "400", "--batch-size", "40",
            "--no-progress", "--threads", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*args, "--epochs", "2", "--seed", "5", "--out", str(straight)]) == 0
    assert main([*args, "--epochs", "1", "--seed", "5", "--out", str(split)]) == 0
    assert main([*args, "--epochs", "2", "--resume", str(split)]) == 0  # no --seed given
    a, b = _weights(straight / "snapshot_latest.pt"), _weights(split / "snapshot_latest.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_profile_refuses_a_training_runs_folder(tmp_path, capsys):
    for name in ("log.jsonl", "snapshot_latest.pt"):
        (tmp_path / name).write_text("x")
    for command in (["mnist-mlp", "--synthetic"], ["--", "python", str(tmp_path / "train.py")]):
        assert main(["profile", "--out", str(tmp_path), *command]) == 2
        assert one_line(capsys.readouterr().err) == (
            f"kasoku: error: --out {tmp_path} holds a training run (log.jsonl, "
            "snapshot_latest.pt); give the profile a folder of its own (--out NEW_DIR), or no "
            "--out for a new one under runs/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "snapshot_latest.pt"]


def test_a_misspelt_option_is_said_by_its_command_with_the_nearest_option(capsys):
    assert main(["train", "mnist-mlp", "--epochz", "1"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "kasoku train: error: unrecognized arguments: --epochz 1; did you mean --epochs? "
        "(see kasoku train --help)")
    assert main(["data", "bench", "--batchs=3"]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        "--batchs=3; did you mean --batches? (see kasoku data bench --help)")
    assert main(["train", "mnist-mlp", "--zzzzzz"]) == 2  # nothing near: no guess
    assert one_line(capsys.readouterr().err) == (
        "kasoku train: error: unrecognized arguments: --zzzzzz (see kasoku train --help)")
