"""``kasoku train --optimizer kfac`` end to end: training, exact resume with channels_last and
bf16, the refusals in one line, the loss scale handed over, settings said to do nothing."""
import json

import pytest
import torch
from kfac_cases import kfac_of, tiny

from kasoku.accel.loss_scale import LossScaler
from kasoku.train import load_snapshot

pytestmark = pytest.mark.usefixtures("one_thread_fresh_lever_warnings")


# --- the command line -------------------------------------------------------------------
def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("# ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_refuses_levers_and_bad_values_in_one_line(tmp_path, capsys):
    from kasoku.cli import main
    base = ["train", "mnist-mlp", "--synthetic", "--optimizer", "kfac", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main([*base, "--cuda-graph"]) == 2
    assert "--cuda-graph with --optimizer kfac" in _one_line(capsys.readouterr().err)
    assert main([*base, "--kfac-factor-decay", "1"]) == 2
    assert "--kfac-factor-decay" in _one_line(capsys.readouterr().err)
    # Refused before any worker starts (data-parallel K-FAC itself: tests/test_kfac_dist.py).
    assert main([*base, "--procs", "2", "--compile"]) == 2
    assert "--compile with --optimizer kfac" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_cli_trains_mnist_mlp_with_kfac_and_the_loss_falls(tmp_path, capsys):
    from kasoku.cli import main
    out = tmp_path / "run"
    assert main(["train", "mnist-mlp", "--synthetic", "--synthetic-size", "300",
                 "--batch-size", "50", "--epochs", "2", "--optimizer", "kfac", "--lr", "0.1",
                 "--kfac-inv-update-freq", "6", "--kfac-damping", "0.003", "--threads", "1",
                 "--no-progress", "--out", str(out)]) == 0
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2]
    assert log[-1]["main/loss"] < log[0]["main/loss"] - 0.1
    state = load_snapshot(out / "snapshot_latest.pt")
    assert state["run"]["optimizer"] == "kfac"
    assert state["optimizer"]["kfac"]["steps"] == 12
    assert set(state["optimizer"]["kfac"]["layers"]) == {"net.1", "net.3", "net.5"}


def test_cli_kfac_with_channels_last_and_bf16_resumes_exactly(tmp_path, capsys):
    from kasoku.cli import main
    args = ["train", "cifar10-lenet5", "--synthetic", "--synthetic-size", "120",
            "--batch-size", "20", "--optimizer", "kfac", "--lr", "0.05", "--channels-last",
            "--precision", "bf16", "--kfac-inv-update-freq", "4", "--kfac-factor-update-freq",
            "2", "--kfac-factor-precision", "bf16", "--threads", "1", "--no-progress"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*args, "--epochs", "2", "--out", str(straight)]) == 0
    assert main([*args, "--epochs", "1", "--out", str(split)]) == 0
    assert main([*args, "--epochs", "2", "--resume", str(split)]) == 0
    a = load_snapshot(straight / "snapshot_latest.pt")
    b = load_snapshot(split / "snapshot_latest.pt")
    assert a["optimizer"]["kfac"]["steps"] == b["optimizer"]["kfac"]["steps"] == 12
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for name, layer in a["optimizer"]["kfac"]["layers"].items():
        assert all(torch.equal(v, b["optimizer"]["kfac"]["layers"][name][k])
                   for k, v in layer.items()), name


def test_build_trainer_hands_the_loss_scale_to_kfac():
    from types import SimpleNamespace

    from kasoku.accel.loss_scale import PrecisionState
    from kasoku.commands.train import _share_loss_scale
    model, _, _ = tiny()
    scaler = LossScaler("cpu")
    accelerated = SimpleNamespace(optimizer=kfac_of(model), extensions=[PrecisionState(scaler)])
    _share_loss_scale(accelerated)
    assert accelerated.optimizer.loss_scale is scaler.scale_value


def test_kfac_settings_without_kfac_are_said_to_do_nothing(tmp_path, capsys):
    from kasoku.cli import main
    assert main(["train", "sine-lstm", "--synthetic-size", "100", "--batch-size", "50",
                 "--epochs", "1", "--no-progress", "--threads", "1", "--kfac-damping", "0.01",
                 "--out", str(tmp_path / "run")]) == 0
    assert "the K-FAC settings have no effect" in capsys.readouterr().err

