"""``benchmarks/train_runs.py``: the rate end to end of real ``kasoku train`` runs (each epoch's
samples over its whole time, validation included), and per worker."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "train_runs.py"


@pytest.fixture(scope="module")
def train_runs():
    spec = importlib.util.spec_from_file_location("train_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workers_from_the_arguments(train_runs):
    assert train_runs.workers_of("--data x --gpus 4 --epochs 3") == 4
    assert train_runs.workers_of("--procs 2") == 2
    assert train_runs.workers_of("--epochs 3") == 1


def test_a_real_run_s_rate_end_to_end(train_runs, tmp_path, capsys):
    out = tmp_path / "runs"
    assert train_runs.main(["mnist-mlp", "--out", str(out), "--common",
                            "--synthetic --synthetic-size 600 --batch-size 100 --epochs 3",
                            "--run", "one="]) == 0
    record = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    log = [json.loads(line) for line in (out / "one" / "log.jsonl").read_text().splitlines()]
    epochs = [e for e in log if train_runs.ACC in e]
    assert record["exit"] == 0 and record["epochs"] == 3 and record["workers"] == 1
    # Epochs 2 and 3: 600 samples each over the time between their log lines.
    unit = next(u for u in train_runs.UNITS if u in epochs[0])
    assert [epochs[k][unit] - epochs[k - 1][unit] for k in (1, 2)] == [600, 600]
    by_epoch = [(epochs[k][unit] - epochs[k - 1][unit])
                / (epochs[k]["elapsed_time"] - epochs[k - 1]["elapsed_time"]) for k in (1, 2)]
    assert record["rate_min"] == pytest.approx(min(by_epoch), abs=0.1)
    assert record["rate_max"] == pytest.approx(max(by_epoch), abs=0.1)
    assert record["rate_per_worker"] == record["rate_median"]
    waits = sorted(e["time/data%"] for e in epochs[1:])
    assert record["data_wait_pct"] == pytest.approx((waits[0] + waits[1]) / 2, abs=0.05)
    assert "| one | 3 |" in capsys.readouterr().out
