"""The command line end to end: real processes where signals and exit codes matter."""
import json
import signal
import subprocess
import sys
import time

import torch

from kasoku.cli import main
from kasoku.train import load_snapshot
from kasoku.workloads import list_workloads


def test_list_shows_every_workload(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in list_workloads():
        assert name in out


def test_missing_dataset_is_a_clear_error(capsys, tmp_path):
    assert main(["train", "mnist-mlp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "--synthetic" in err and "kasoku data download mnist" in err
    assert main(["train", "mnist-mlp", "--data", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_bad_settings_are_clear_errors(capsys, tmp_path):
    assert main(["train", "sine-lstm", "--device", "cuda:7", "--out", str(tmp_path)]) == 2
    assert "cuda:7" in capsys.readouterr().err
    assert main(["train", "sine-lstm", "--device", "tpu", "--out", str(tmp_path)]) == 2
    assert main(["train", "sine-lstm", "--out", str(tmp_path), "--resume",
                 str(tmp_path / "missing.pt")]) == 2
    assert "no snapshot" in capsys.readouterr().err
    assert main(["train", "no-such-workload"]) == 2
    assert "kasoku list" in capsys.readouterr().err
    (tmp_path / "bad.pt").write_bytes(b"not a snapshot")
    assert main(["train", "sine-lstm", "--out", str(tmp_path), "--resume",
                 str(tmp_path / "bad.pt")]) == 2
    assert "bad.pt" in capsys.readouterr().err


def _weights(path):
    return load_snapshot(path)["model"]


def test_train_writes_log_plots_and_snapshot_and_resumes_exactly(tmp_path, capsys):
    args = ["train", "sine-lstm", "--synthetic-size", "300", "--batch-size", "50",
            "--no-progress", "--seed", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(args + ["--epochs", "2", "--out", str(straight)]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[0].split() == ["epoch", "main/loss", "validation/main/loss",
                                          "elapsed_time"]
    log = [json.loads(line) for line in open(straight / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2]
    assert log[1]["main/loss"] < log[0]["main/loss"]
    assert (straight / "loss.png").stat().st_size > 1000

    assert main(args + ["--epochs", "1", "--out", str(split)]) == 0
    assert main(args + ["--epochs", "2", "--out", str(split), "--resume"]) == 0
    a, b = _weights(straight / "snapshot_latest.pt"), _weights(split / "snapshot_latest.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["epoch"] for line in open(split / "log.jsonl")] == [1, 2]


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
    assert "resume with" in err
    assert "to continue this run: kasoku train mnist-mlp --synthetic" in err
    assert err.rstrip().endswith(f"--resume {out / 'snapshot_latest.pt'}")
    state = load_snapshot(out / "snapshot_latest.pt")
    stopped_at = state["updater"]["iteration"]
    assert stopped_at > 0
    done = subprocess.run(cmd[:-2] + ["--epochs", str(stopped_at / 20 + 1), "--resume"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_snapshot(out / "snapshot_latest.pt")["updater"]["iteration"] > stopped_at


def test_make_jpeg_then_train_resnet50_on_the_folder(tmp_path, capsys):
    folder = tmp_path / "jpegs"
    assert main(["data", "make-jpeg", str(folder), "--count", "4", "--classes", "2",
                 "--resolution", "96x72"]) == 0
    assert len(list(folder.glob("class_*/*.jpg"))) == 4
    torch.set_num_threads(2)
    assert main(["train", "imagenet-resnet50", "--data", str(folder), "--epochs", "1",
                 "--batch-size", "2", "--out", str(tmp_path / "r50"), "--no-progress"]) == 0
    log = [json.loads(line) for line in open(tmp_path / "r50" / "log.jsonl")]
    assert log[-1]["iteration"] == 2 and "main/loss" in log[-1]


def test_device_loader_trains_the_same_weights_as_serial(tmp_path):
    args = ["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50",
            "--epochs", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "s")]) == 0
    assert main(args + ["--out", str(tmp_path / "d"), "--loader", "device"]) == 0
    a = _weights(tmp_path / "s" / "snapshot_latest.pt")
    b = _weights(tmp_path / "d" / "snapshot_latest.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_with_prefetch(tmp_path, capsys):
    args = ["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50",
            "--epochs", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "t"), "--loader", "threads:2",
                        "--prefetch", "4"]) == 0
    assert main(args + ["--out", str(tmp_path / "s"), "--prefetch", "4"]) == 2
    assert "the serial loader makes each batch when it is asked" in capsys.readouterr().err
