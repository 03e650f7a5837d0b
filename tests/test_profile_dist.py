"""``kasoku profile --procs 2``: the profile of worker 0 of a real data-parallel run (two gloo
processes started by PyTorch's elastic launcher), with gloo's all-reduce in the trace, and
``--confirm`` run from the launching process, each side launching its own workers."""
from __future__ import annotations

import json

import pytest

from kasoku.cli import main


@pytest.mark.slow  # 18 s on 2 cores: the profile and its --confirm launches
def test_worker_0_profiles_a_2_process_run_and_confirms(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the sides would leave folders of their own
    out = tmp_path / "prof"
    code = main(["profile", "mnist-mlp", "--synthetic", "--procs", "2", "--steps", "4",
                 "--warmup", "1", "--skip", "3", "--measure-steps", "6", "--confirm",
                 "--measure-seconds", "0.2",
                 "--estimate", "--rounds", "1", "--out", str(out)])
    printed = capfd.readouterr()
    assert code == 0, printed.err
    result = json.loads((out / "profile.json").read_text())
    f = result["figures"]
    assert f["device"] == "cpu" and f["comm_pct"] > 0 and f["comm_ms"] > 0
    assert result["settings"]["batch_size"] == 100
    assert (out / "trace.json").is_file() and (out / "worker1" / "trace.json").is_file()
    assert not (out / "worker1" / "profile.json").exists()  # worker 0 speaks for all
    assert printed.out.count("verdict:") == 1
    # The ladder: the run as given, then the verdict's experiments, each its own launch.
    ladder = result["ladder"]
    assert ladder[0]["label"] == "as given" and ladder[0]["samples_per_s"] > 0
    assert len(ladder) == 1 + len(result["verdict"]["experiments"])
    for row in ladder[1:]:
        assert row["samples_per_s"] > 0 and (row["outcome"] in ("confirmed", "refuted")
                                             or row["outcome"].startswith("inconclusive"))
        assert "--procs 2" in row["command"]  # the sides ran with the workers
    assert "confirm (fresh processes" in printed.out
    assert "Traceback" not in printed.err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_sharded_run_is_profiled_with_its_all_gathers_and_reduce_scatters(tmp_path, capfd):
    """``--shard`` (FSDP2): worker 0's profile of tiny gpt on 2 gloo processes, whose
    communication share counts FSDP2's all-gathers and reduce-scatters (gloo runs the
    reduce-scatter as an all-reduce)."""
    out = tmp_path / "prof"
    code = main(["profile", "gpt", "--synthetic", "--procs", "2", "--shard", "--estimate",
                 "--skip", "2", "--measure-steps", "3", "--warmup", "1", "--steps", "2",
                 "--out", str(out)])
    assert code == 0, capfd.readouterr().err
    result = json.loads((out / "profile.json").read_text())
    assert result["workers"] == 2 and result["figures"]["comm_pct"] > 0
    names = {e.get("name") for e in json.loads((out / "trace.json").read_text())["traceEvents"]}
    assert {"gloo:all_gather", "gloo:all_reduce"} <= names
