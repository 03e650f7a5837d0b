"""``kasoku scale --data DIR``: every worker reads its own shard of the real dataset through a
loader of the registry (real processes over gloo, as in test_scale.py), the records and the
table name the data and the loader, a step's wait for its batch is measured and explained, and
the requests that cannot run are one line before any worker starts."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from kasoku.cli import main
from kasoku.commands import scale
from kasoku.commands.scale_feed import SAMPLES_ENV, sample_fingerprints
from kasoku.data.config import DataConfig
from kasoku.data.jpeg_synth import make_jpeg_folder
from kasoku.workloads import create_workload

BATCH = 50
LOADER = "multiprocess:1"


def test_each_worker_reads_its_own_shard_of_real_mnist(mnist_dir, tmp_path, capsys,
                                                       monkeypatch):
    """`kasoku scale mnist-mlp --procs 1,2 --data MNIST --loader multiprocess:1`: every sample
    a worker stepped on is one of MNIST's training samples (their bytes after the workload's
    transform), a fresh one at every step, and the 2 workers' samples are disjoint."""
    seen = tmp_path / "seen"
    monkeypatch.setenv(SAMPLES_ENV, str(seen))
    out = tmp_path / "scale"
    code = main(["scale", "mnist-mlp", "--procs", "1,2", "--data", str(mnist_dir),
                 "--loader", LOADER, "--batch-size", str(BATCH), "--steps", "2",
                 "--windows", "2", "--warmup", "1", "--no-chart", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records] == [1, 2]

    train, _ = create_workload("mnist-mlp").build_datasets(DataConfig(root=mnist_dir))
    in_dataset = Counter(sample_fingerprints(train.get_batch(torch.arange(len(train)))))
    for r in records:
        n, data = r["world_size"], r["data"]
        assert data["source"] == "files" and data["loader"] == LOADER
        assert data["root"] == str(mnist_dir.resolve())
        assert data["train_samples"] == len(train)
        assert data["samples_per_worker"] == -(-len(train) // n)
        # Every step pulled a batch: the warm-ups and every window of both measurements.
        steps = 2 * 1 + 2 * (len(r["alone_step_ms_windows"]) + len(r["step_ms_windows"]))
        assert data["samples_read_per_worker"] == steps * BATCH
        # The wait is part of the step: never longer than it, window by window.
        assert len(r["data_wait_ms_windows"]) == len(r["step_ms_windows"])
        assert all(0 <= w <= s for w, s in zip(r["data_wait_ms_windows"],
                                                r["step_ms_windows"]))
        assert 0 <= r["alone_data_wait_ms"] <= r["alone_step_ms"]
        shards = [Counter(json.loads((seen / f"samples-{n}w-rank{rank}.json").read_text())
                          ["fingerprints"]) for rank in range(n)]
        for shard in shards:
            assert sum(shard.values()) == steps * BATCH
            assert set(shard) <= set(in_dataset)  # real samples of the training split
        together = sum(shards, Counter())
        # No sample read more often than MNIST holds it (a few images occur twice): each
        # worker read fresh samples at every step and none of the other worker's.
        assert all(count <= in_dataset[fp] for fp, count in together.items())
    two = shards  # the 2-worker launch's
    assert set(two[0]) & set(two[1]) <= {fp for fp, c in in_dataset.items() if c > 1}

    table = printed.out
    assert f"data: {mnist_dir.resolve()} through the {LOADER} loader" in table
    assert "data wait (ms)" in table
    assert "data, 2 workers: 60,000 training samples, a shard of 30,000 per worker" in table
    assert "mnist-mlp, 2 workers:" in table


@pytest.fixture
def jpeg_dir(tmp_path):
    return make_jpeg_folder(tmp_path / "jpeg", num_images=4, width=16, height=16,
                            num_classes=2, progress=False, workers=1)["out"]


@pytest.mark.parametrize("argv, message", [
    (["--data", "{tmp}/nope"], "/nope does not exist"),
    (["--loader", "serial"], "--loader needs --data DIR"),
    (["--data", "{jpeg}", "--loader", "device"],
     "--loader device: the device loader cannot read this dataset (ImageFolder"),
    (["--procs", "2", "--data", "{jpeg}", "--batch-size", "4"],
     "4 training samples give each of 2 workers 2, fewer than a batch of 4"),
    (["--data", "{jpeg}", "--loader", "nope"], "unknown loader 'nope'"),
])
def test_data_requests_that_cannot_run_are_one_line(tmp_path, jpeg_dir, capsys, argv,
                                                    message):
    argv = [x.format(tmp=tmp_path, jpeg=jpeg_dir) for x in argv]
    procs = [] if "--procs" in argv else ["--procs", "1"]
    out = tmp_path / "o"
    code = main(["scale", "imagenet-resnet50", *procs, *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # refused before a folder is made or a worker starts


def _record(n, step_ms, alone_ms, wait_ms, loader="serial", kind="in-memory", device="cpu"):
    return {"workload": "w", "unit": "samples", "world_size": n, "device_type": device,
            "backend": "gloo", "rung": "r", "config": {}, "batch_size_per_worker": 100,
            "global_batch_size": 100 * n, "threads_per_worker": 1, "allreduce_dtype": "fp32",
            "step_ms": step_ms, "alone_step_ms": alone_ms,
            "exposed_allreduce_ms": max(0.0, step_ms - alone_ms),
            "exposed_allreduce_pct": 100 * max(0.0, step_ms - alone_ms) / step_ms,
            "allreduce_alone_ms": 0.1, "samples_per_s": 100 * n / (step_ms / 1e3),
            "alone_samples_per_s_per_worker": 100 / (alone_ms / 1e3),
            "data": {"source": "files", "loader": loader, "dataset_kind": kind,
                     "loader_workers_per_worker": 0},
            "data_wait_ms": wait_ms, "alone_data_wait_ms": wait_ms}


def test_a_loader_that_keeps_the_steps_waiting_is_named_with_what_would_help():
    rows = scale.summarize([_record(1, 10.0, 10.0, 6.0), _record(2, 10.4, 10.0, 6.2)])
    line = rows[1]["explanation"]
    assert "60% of each step (6.20 ms of 10.40) waits for the serial loader's batches" in line
    assert "--loader multiprocess" in line.split("Would help:")[1]
    one = rows[0]["explanation"]
    assert "60% of each step (6.00 ms of 10.00) waits for the serial loader's batches" in one


def test_a_short_wait_is_not_named():
    rows = scale.summarize([_record(1, 10.0, 10.0, 1.0), _record(2, 10.1, 10.0, 1.0)])
    assert all("loader" not in row["explanation"] for row in rows)


def test_a_longer_wait_for_batches_is_not_called_all_reduce(tmp_path):
    # 2 workers: the step takes 4 ms more than alone, 3 of them waiting longer for batches.
    two = dict(_record(2, 14.0, 10.0, 4.0), alone_data_wait_ms=1.0, more_data_wait_ms=3.0,
               exposed_allreduce_ms=1.0, exposed_allreduce_pct=100 / 14)
    rows = scale.summarize([_record(1, 10.0, 10.0, 1.0), two])
    line = rows[1]["explanation"]
    assert "waits 3.00 ms longer for its batch than the step alone" in line
    assert "is all-reduce not hidden" not in line  # 1 ms of 14: not the limit
    two["env"] = {"device_name": "cpu"}
    one = dict(_record(1, 10.0, 10.0, 1.0), env={"device_name": "cpu"})
    chart = scale.plot_scale([one, two], tmp_path / "scale.png")
    assert Path(chart).stat().st_size > 0
