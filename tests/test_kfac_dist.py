"""K-FAC over data-parallel workers (kasoku.kfac.distributed): the assignment of the
eigendecompositions to workers, and real gloo workers started by ``kasoku train --procs 2``
training as one process on the concatenated batch (factors averaged, eigenbases sent from
their owners), in fp32 and with the factors sent in bf16, and resuming exactly.

The runs a test compares are independent processes and start together: a launch of 2 workers
keeps 2 cores busy only part of its time (the launcher starting, worker 0 alone at the end)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kasoku.kfac.distributed import assign
from kasoku.train import load_snapshot

LENET = ["cifar10-lenet5", "--synthetic", "--synthetic-size", "240", "--no-progress",
         "--seed", "5", "--optimizer", "kfac", "--lr", "0.05", "--kfac-damping", "0.003",
         "--kfac-inv-update-freq", "2", "--kfac-factor-decay", "0.5", "--threads", "1"]
"""Conv2d and Linear layers; an inverse step every other step, so bases are decomposed on
both workers and sent in the steps run (240 samples: 4 steps of 2 x 30); a low factor decay,
so the batch factors weigh in the running ones."""


class Kasoku:
    """``kasoku *argv`` started now in a fresh process, outside any launcher (as
    tests/test_dist.py); ``done()`` waits for it and asserts it succeeded."""

    def __init__(self, *argv, timeout=180):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        self.argv, self.timeout, self.result = [str(a) for a in argv], timeout, None
        self.out = Path(self.argv[self.argv.index("--out") + 1])
        # Files, not pipes: a process would stall on a full pipe while another is waited for.
        self.logs = [Path(tempfile.mkstemp(prefix="kasoku-", suffix=f".{name}")[1])
                     for name in ("out", "err")]
        with open(self.logs[0], "w") as out, open(self.logs[1], "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "kasoku", *self.argv],
                                         env=env, stdout=out, stderr=err)

    def done(self) -> subprocess.CompletedProcess:
        if self.result is None:
            try:
                self.proc.wait(timeout=self.timeout)
            finally:
                self.stop()
            out, err = (path.read_text() for path in self.logs)
            for path in self.logs:
                path.unlink()
            self.result = subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                                      out, err)
        done = self.result
        assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
        return done

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def kasoku(*argv, timeout=180) -> subprocess.CompletedProcess:
    """``kasoku *argv`` in a fresh process, waited for (``Kasoku``)."""
    return Kasoku(*argv, timeout=timeout).done()


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The reference of the fp32 and bf16 tests: one process on the batch of 60, started at
    the first test that needs it, beside that test's own runs."""
    run = Kasoku("train", *LENET, "--batch-size", "60", "--epochs", "1", "--out",
                 tmp_path_factory.mktemp("kfac") / "one")
    yield run
    run.stop()


def assert_same(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m: f"{k}: {m}")


# --- the assignment ---------------------------------------------------------------------
def test_assignment_is_deterministic_and_balanced():
    dims = [(76, 6), (151, 16), (1921, 120), (121, 84), (85, 10), (1001, 1000), (785, 1000)]
    owners = assign(dims, 2)
    assert owners == assign(list(dims), 2)  # no state, no randomness: the same on every rank
    assert all(0 <= r < 2 for pair in owners for r in pair)
    work = [0, 0]
    for pair, ranks in zip(dims, owners):
        for d, r in zip(pair, ranks):
            work[r] += d ** 3
    # Greedy largest-first: no worker is behind the other by more than the largest job.
    assert abs(work[0] - work[1]) <= max(d for pair in dims for d in pair) ** 3
    assert min(work) > 0.3 * max(work)
    # Equal factors spread evenly; one worker takes all; more workers than factors idle some.
    assert sorted(r for pair in assign([(100, 100)] * 4, 4) for r in pair) == \
        [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign(dims, 1) == [(0, 0)] * len(dims)
    assert assign([(10, 20)], 3) == [(1, 0)]


# --- real workers -----------------------------------------------------------------------
def _kfac_state(run):
    return load_snapshot(run / "snapshot_latest.pt")["optimizer"]["kfac"]


def _rebuilt(layer: dict, key: str) -> torch.Tensor:
    q = layer["Q" + key]
    return q @ torch.diag(layer["L" + key]) @ q.t()


def test_two_workers_train_as_one_process_on_the_whole_batch(tmp_path, one):
    two = Kasoku("train", *LENET, "--procs", "2", "--batch-size", "30", "--epochs", "1",
                 "--out", tmp_path / "two")
    still = Kasoku("train", *LENET, "--batch-size", "60", "--epochs", "1", "--lr", "1e-12",
                   "--out", tmp_path / "still")
    assert "2 processes (gloo), batch 30 per worker, 60 in all" in two.done().stderr
    one.done()
    a, b = (load_snapshot(d / "snapshot_latest.pt") for d in (tmp_path / "two", one.out))
    assert a["optimizer"]["kfac"]["steps"] == b["optimizer"]["kfac"]["steps"] == 4
    assert_same(a["model"], b["model"], rtol=1e-4, atol=1e-6)
    # The running factors, and the eigenbases in use (of the factors two steps back): those of
    # one process; eigenvectors are compared as the matrices they rebuild (signs are free).
    for name, mine in a["optimizer"]["kfac"]["layers"].items():
        ref = b["optimizer"]["kfac"]["layers"][name]
        for key in "AG":
            torch.testing.assert_close(mine[key], ref[key], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(_rebuilt(mine, key), _rebuilt(ref, key), rtol=1e-3,
                                       atol=1e-5)
    # The weights moved away from the start: the comparison is not vacuous.
    still.done()
    still = load_snapshot(tmp_path / "still" / "snapshot_latest.pt")["model"]
    assert any(not torch.allclose(still[k], b["model"][k], atol=1e-4) for k in still)


def test_two_workers_share_the_inverse_methods_inverses(tmp_path):
    inverse = [*LENET, "--kfac-method", "inverse", "--epochs", "1"]
    runs = [Kasoku("train", *inverse, "--procs", "2", "--batch-size", "30", "--out",
                   tmp_path / "two"),
            Kasoku("train", *inverse, "--batch-size", "60", "--out", tmp_path / "one")]
    for run in runs:
        run.done()
    a, b = (load_snapshot(tmp_path / d / "snapshot_latest.pt") for d in ("two", "one"))
    assert_same(a["model"], b["model"], rtol=1e-4, atol=1e-6)
    for name, mine in a["optimizer"]["kfac"]["layers"].items():
        ref = b["optimizer"]["kfac"]["layers"][name]
        for key in "AG":
            assert mine["L" + key] is None
            torch.testing.assert_close(mine["Q" + key], ref["Q" + key], rtol=1e-3, atol=1e-4)


def test_factors_sent_in_bf16_stay_close(tmp_path, one):
    kasoku("train", *LENET, "--procs", "2", "--batch-size", "30", "--epochs", "1",
           "--kfac-factor-comm-dtype", "bf16", "--out", tmp_path / "bf16")
    one.done()
    a, b = _kfac_state(tmp_path / "bf16"), _kfac_state(one.out)
    for name, layer in a["layers"].items():
        for key in "AG":
            assert layer[key].dtype == torch.float32  # the average is kept in fp32
            # bf16 keeps 8 bits of mantissa: 2^-8 of the largest entries.
            err = (layer[key] - b["layers"][name][key]).abs().max()
            assert err <= 2 ** -7 * b["layers"][name][key].abs().max(), (name, key)


@pytest.mark.slow  # 18 s: three 2-worker runs (one process's resume: test_kfac_cli)
def test_resume_with_two_workers_is_exact(tmp_path):
    run = ["train", *LENET, "--procs", "2", "--batch-size", "30", "--snapshot-interval", "3"]
    whole = Kasoku(*run, "--epochs", "2", "--out", tmp_path / "whole")
    kasoku(*run, "--epochs", "1", "--out", tmp_path / "split")
    kasoku(*run, "--epochs", "2", "--out", tmp_path / "split", "--resume", "auto")
    whole.done()
    a, b = (load_snapshot(tmp_path / d / "snapshot_latest.pt") for d in ("whole", "split"))
    assert_same(a["model"], b["model"], rtol=0, atol=0)
    assert a["optimizer"]["kfac"]["steps"] == b["optimizer"]["kfac"]["steps"] == 8
    for name, layer in a["optimizer"]["kfac"]["layers"].items():
        for key, value in layer.items():
            assert torch.equal(value, b["optimizer"]["kfac"]["layers"][name][key]), (name, key)

