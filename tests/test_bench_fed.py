"""The ladder's loader rung (``kasoku bench --data DIR``): the rung before it fed by a loader
from the workload's dataset, end to end in worker processes on the CPU, on an MNIST folder in
the real IDX format; kasoku's pick of the loader; the settings it refuses; on a CPU, the
cores split between the step and the loader's workers."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_bench_ladder import FAST, bench
from test_data_mnist import write_mnist

from kasoku.commands.bench import fed
from kasoku.core.errors import ConfigError
from kasoku.data.base import ArrayDataset
from kasoku.data.imagefolder import ImageFolder
from kasoku.workloads import create_workload


@pytest.mark.slow  # 14 s on 2 cores: a bench sweep of three runs
def test_loader_rung_feeds_the_rung_before_it_from_the_dataset(tmp_path):
    data = write_mnist(tmp_path / "mnist", n_train=200, n_test=20)
    out = tmp_path / "out"
    code, text = bench(["mnist-mlp", "--batch-size", "16", "--config", "fp32", "--data",
                        str(data), "--out", str(out), *FAST])
    assert code == 0, text
    records = {r["rung"]: r for r in map(json.loads, (out / "results.jsonl").read_text()
                                         .splitlines())}
    assert list(records) == ["fp32", "plain", fed.LABEL]
    rec = records[fed.LABEL]
    assert rec["status"] == "ok" and rec["config"] == records["fp32"]["config"]
    assert rec["figures"]["samples_per_s"]["median"] > 0
    # The device loader over the 200 training images of the folder, not the synthetic pool.
    assert rec["data"]["loader"] == "device" and rec["data"]["train_samples"] == 200
    assert rec["data"]["source"] == f"device loader, {data}"
    assert records["fp32"]["data"]["source"] == "synthetic on-device"
    # Real batches: the losses are kept, checked finite, and not compared with fp32's.
    numerics = rec["numerics"]
    assert numerics["status"] == "n/a" and numerics["reason"] == fed.NUMERICS_REASON
    assert len(numerics["losses"]) == 4 and all(np.isfinite(numerics["losses"]))
    assert f"{fed.LABEL} fed by the device loader, {data}" in text
    assert f"note: {fed.LABEL}: the fp32 rung fed by the loader kasoku picks" in text


def _fed_mnist_rung(tmp_path, loader: str) -> tuple[dict, str]:
    """bench's fp32 rung on small real-format MNIST fed by ``loader``: its record and the
    printed text (the command has succeeded)."""
    data = write_mnist(tmp_path / "mnist", n_train=64, n_test=8)
    out = tmp_path / "out"
    code, text = bench(["mnist-mlp", "--batch-size", "16", "--config", "fp32", "--data",
                        str(data), "--loader", loader, "--out", str(out), *FAST,
                        "--numerics-steps", "0"])
    assert code == 0, text
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()][-1], text


def test_kasoku_picks_the_loader_by_dataset_and_device(tmp_path):
    in_memory = ArrayDataset(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.zeros(4))
    assert fed.fastest_loader(in_memory, "cuda") == "device"
    assert fed.fastest_loader(in_memory, "cpu") == "device"
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cat" / "a.jpg")
    folder = ImageFolder(tmp_path, train=True)
    assert fed.fastest_loader(folder, "cuda") == "gpu-jpeg"
    assert fed.fastest_loader(folder, "cpu").startswith("multiprocess:")


@pytest.mark.parametrize("argv, message", [
    (["--loader", "device"], "--loader needs --data DIR"),
    (["--data", "/no/such/folder"], "no such folder"),
    (["--data", ".", "--loader", "bogus"], "bogus"),
])
def test_loader_settings_that_cannot_work_are_refused(argv, message, capsys):
    code, _ = bench(["mnist-mlp", "--device", "cpu", "--config", "fp32", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_dataset_smaller_than_a_batch_is_a_clear_error(tmp_path):
    data = write_mnist(tmp_path / "mnist", n_train=8, n_test=2)
    with pytest.raises(ConfigError, match="fewer than one batch of 16"):
        fed.FedBatches(create_workload("mnist-mlp"), data, None, 16, torch.device("cpu"))


def test_a_multi_step_rung_is_refused(tmp_path, capsys):
    data = write_mnist(tmp_path / "mnist", n_train=64, n_test=8)
    code, _ = bench(["mnist-mlp", "--device", "cpu", "--config", "fp32,steps_per_call=4",
                     "--data", str(data), "--out", str(tmp_path / "out"), *FAST])
    assert code == 2 and "one batch per step; steps_per_call=4" in capsys.readouterr().err


@pytest.mark.slow  # 15 s: a fed bench run (the cores' split: test_loader_cores)
def test_a_named_loader_is_used_and_its_workers_get_cores_of_their_own(tmp_path):
    from test_loader_cores import usable_cores
    rec, text = _fed_mnist_rung(tmp_path, "multiprocess:1")
    assert rec["rung"] == fed.LABEL and rec["status"] == "ok"
    assert rec["data"]["loader"] == "multiprocess:1"  # the loader named, not kasoku's pick
    if len(usable_cores()) < 2:
        pytest.skip("the cores' split needs 2 usable physical cores and the affinity API")
    threads = rec["settings"]["cpu_threads"]
    # --threads 1: the step keeps one core, the one worker takes the last.
    assert threads["threads"] == rec["env"]["torch_threads"] == 1
    assert threads["loader_cpus"] == usable_cores()[-1:] and threads["loader_workers"] == 1
    assert not set(threads["pinned_cpus"]) & set(threads["loader_cpus"])
    assert f"1 loader worker on CPUs {threads['loader_cpus']}" in text


def test_no_loader_cores_leaves_the_workers_on_the_step_cores(tmp_path):
    data = write_mnist(tmp_path / "mnist", n_train=64, n_test=8)
    batches = fed.FedBatches(create_workload("mnist-mlp"), data, "multiprocess:1", 16,
                             torch.device("cpu"), cores=False)
    try:
        assert batches.cores == {"loader_workers": 1, "loader_cpus": None,
                                 "loader_note": "--no-loader-cores"}
        assert batches.loader.worker_cpus is None
    finally:
        batches.close()


def test_no_loader_cores_is_a_bench_flag_too():
    from kasoku.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["bench", "mnist-mlp"]).loader_cores is True
    assert parser.parse_args(["bench", "mnist-mlp", "--no-loader-cores"]).loader_cores is False


def test_the_table_names_the_loader_rungs_cores():
    from kasoku.commands.bench import report
    threads = {"threads": 1, "interop_threads": 1, "pinned_cpus": [0], "loader_workers": 2,
               "loader_cpus": [1], "loader_note": None}
    rung = {"rung": "+loader", "batch_size": 16, "settings": {"cpu_threads": threads}}
    plain = {"rung": "plain", "batch_size": 16, "settings": {"cpu_threads": {"threads": 2}}}
    assert report.loader_core_lines([plain, rung, dict(rung, batch_size=32)]) == [
        "+loader: 1 compute thread on CPUs [0], 2 loader workers on CPUs [1]"]
