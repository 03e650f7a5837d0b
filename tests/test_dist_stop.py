"""How a data-parallel run ends when it does not end by itself (2 gloo workers on the CPU,
real processes): Ctrl-C stops every worker at one iteration after a snapshot and the run
resumes bit-identical; a second Ctrl-C stops it at once; a failed worker is named, never one
the launcher stopped, with the command that resumes the run."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from test_dist import faulty_workload, workers_of

from kasoku.train import load_snapshot

MNIST = ["train", "mnist-mlp", "--synthetic", "--synthetic-size", "1200", "--no-progress",
         "--seed", "3", "--procs", "2", "--batch-size", "10", "--epochs", "2"]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in LAUNCHER_ENV:
        env.pop(key, None)
    return env


def kasoku(*argv, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kasoku", *map(str, argv)], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(*argv) -> subprocess.Popen:
    """``kasoku ARGV`` in a session of its own, as a terminal's foreground job."""
    return subprocess.Popen([sys.executable, "-m", "kasoku", *map(str, argv)], env=_env(),
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def wait_for(path: Path, job: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not path.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert job.poll() is None and path.exists(), f"{path} never came"


def weights(run: Path) -> dict:
    return load_snapshot(run / "snapshot_latest.pt")["model"]


def test_ctrl_c_stops_every_worker_at_one_iteration_and_the_run_resumes_exactly(tmp_path):
    whole = start(*MNIST, "--out", tmp_path / "whole")  # beside the cut run: start-ups overlap
    job = start(*MNIST, "--out", tmp_path / "cut")
    wait_for(tmp_path / "cut" / "log.jsonl", job)  # the first epoch is done
    os.killpg(job.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-2000:]
    stopped = re.search(r"every worker stopped at iteration (\d+), snapshot (\S+)", err)
    assert stopped, err[-2000:]
    iteration = int(stopped.group(1))
    state = load_snapshot(Path(stopped.group(2)))
    assert state["updater"]["iteration"] == iteration < 240  # 2 epochs of 120 steps
    assert len(state["rng_by_worker"]) == 2  # both workers took part in the snapshot
    resume = re.search(r"to continue this run: (.+)", err).group(1)
    assert resume.startswith("kasoku ") and "--resume" in resume
    _, whole_err = whole.communicate(timeout=180)
    assert whole.returncode == 0, whole_err[-2000:]
    again = kasoku(*shlex.split(resume)[1:])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"iteration {iteration}" in again.stderr  # resumed where it stopped
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_a_second_ctrl_c_stops_at_once_and_leaves_no_worker(tmp_path):
    job = start(*MNIST, "--epochs", "50", "--out", tmp_path / "run")
    wait_for(tmp_path / "run" / "log.jsonl", job)
    workers = workers_of(job.pid)
    assert len(workers) == 2, workers
    os.killpg(job.pid, signal.SIGINT)
    os.killpg(job.pid, signal.SIGINT)
    began = time.time()
    job.communicate(timeout=60)
    assert job.returncode == 130
    assert time.time() - began < 15  # the launcher's shutdown, not the 50 epochs
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_a_killed_worker_is_named_not_the_one_the_launcher_stopped(tmp_path):
    job = start(*MNIST, "--epochs", "50", "--snapshot-interval", "20", "--out", tmp_path / "run")
    wait_for(tmp_path / "run" / "snapshot_latest.pt", job)
    workers = workers_of(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # the second worker started is rank 1
    _, err = job.communicate(timeout=120)
    assert job.returncode == 1
    line = next(ln for ln in err.splitlines() if ln.startswith("kasoku: error:"))
    assert "worker 1 failed (signal 9, SIGKILL)" in line, err[-2000:]
    assert "no error of its own" in line
    assert "to continue this run: kasoku train mnist-mlp" in err
    assert "--max-restarts 1 would have restarted" in err


def test_a_worker_with_an_error_of_its_own_is_named_with_it(tmp_path):
    boom = faulty_workload(tmp_path / "boom.py",
                           "raise RuntimeError(\"worker 1's own error in its third step\")")
    done = kasoku("train", boom, "--procs", "2", "--no-progress",
                  "--device", "cpu", "--out", tmp_path / "run")
    assert done.returncode == 1
    line = next(ln for ln in done.stderr.splitlines()
                if ln.startswith("kasoku: error: worker") and "so the job stopped" in ln)
    assert "worker 1 failed (exit code 1)" in line, done.stderr[-2000:]
    assert "worker 1's own error in its third step" in line
    assert "no snapshot was written" in done.stderr
