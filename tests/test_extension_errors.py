"""The failure path of every extension: a run whose step fails mid-epoch calls each
extension's ``on_error(trainer, exc)`` and ``finalize``, none of which fails in turn, and the
original exception comes out unchanged; the log and the snapshot left behind agree."""
import json

import pytest
import torch
from torch import nn

from kasoku.accel.loss_scale import LossScaler, PrecisionState
from kasoku.accel.multistep import ShortChunkCheck
from kasoku.data.base import ArrayDataset
from kasoku.data.loader import SerialLoader
from kasoku.train import Trainer, extensions, load_snapshot
from kasoku.train.step import StandardStep
from kasoku.train.triggers import ManualScheduleTrigger

FAIL_AT = 7
"""The iteration whose step raises."""


class StepFailed(RuntimeError):
    pass


def failing_trainer(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    dataset = ArrayDataset(x, (x[:, 0] > 0).long())
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = StandardStep(nn.functional.cross_entropy)
    calls = {"n": 0}

    def failing(model, batch, optimizer):
        calls["n"] += 1
        if calls["n"] == FAIL_AT:
            raise StepFailed("the step broke")
        return step(model, batch, optimizer)

    trainer = Trainer(model, optimizer, SerialLoader(dataset, 8, seed=0),
                      nn.functional.cross_entropy, stop_trigger=(3, "epoch"), out=tmp_path,
                      step_fn=failing)
    return trainer, dataset


# Every extension kasoku ships, as kasoku train registers it (or as a user would).
FACTORIES = {
    "BadFileLog": lambda t, d: extensions.BadFileLog(),
    "CosineLR": lambda t, d: extensions.CosineLR(3),
    "StepLR": lambda t, d: extensions.StepLR(1),
    "LinearWarmup": lambda t, d: extensions.LinearWarmup(1),
    "Evaluator": lambda t, d: extensions.Evaluator(d, t.model, nn.functional.cross_entropy),
    "FailOnNonNumber": lambda t, d: extensions.FailOnNonNumber(),
    "LogReport": lambda t, d: extensions.LogReport(trigger=(1, "iteration")),
    "PlotReport": lambda t, d: extensions.PlotReport(["main/loss"], min_interval_s=0),
    "PrintReport": lambda t, d: extensions.PrintReport(["epoch", "main/loss"]),
    "ProgressBar": lambda t, d: extensions.ProgressBar(plain_interval=0),
    "SkippedReport": lambda t, d: extensions.SkippedReport(),
    "Snapshot": lambda t, d: extensions.Snapshot(trigger=ManualScheduleTrigger(4, "iteration")),
    "PrecisionState": lambda t, d: PrecisionState(LossScaler("cpu")),
    "ShortChunkCheck": lambda t, d: ShortChunkCheck(3),
}
BASES = {"LRSchedule", "NonFiniteError"}


def test_every_shipped_extension_is_in_the_table():
    shipped = set(extensions.__all__) - BASES
    assert shipped <= set(FACTORIES), sorted(shipped - set(FACTORIES))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_error_path_of_each_extension(name, tmp_path, capsys):
    trainer, dataset = failing_trainer(tmp_path)
    if name in ("PlotReport", "PrintReport"):
        trainer.extend(extensions.LogReport(trigger=(1, "iteration")))
    extension = FACTORIES[name](trainer, dataset)
    trainer.extend(extension)
    seen = []
    on_error = getattr(extension, "on_error", None)
    if on_error is not None:
        def spy(t, exc):
            seen.append(exc)
            return on_error(t, exc)
        extension.on_error = spy
    with pytest.raises(StepFailed, match="the step broke"):
        trainer.run()
    err = capsys.readouterr().err
    assert "failed" not in err and "Traceback" not in err, err  # no hook failed in turn
    if on_error is not None:
        assert len(seen) == 1 and isinstance(seen[0], StepFailed)


def test_the_log_is_cut_back_to_the_snapshot_and_the_rest_kept_apart(tmp_path):
    trainer, _ = failing_trainer(tmp_path)
    trainer.extend(extensions.LogReport(trigger=(1, "iteration")))
    trainer.extend(extensions.Snapshot(trigger=ManualScheduleTrigger(4, "iteration")))
    with pytest.raises(StepFailed):
        trainer.run()
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    after = [json.loads(line) for line in open(tmp_path / "log.failed.jsonl")]
    assert [e["iteration"] for e in log] == [1, 2, 3, 4]
    assert [e["iteration"] for e in after] == [5, 6]  # step 7 failed: never logged
    assert load_snapshot(tmp_path / "snapshot_latest.pt")["updater"]["iteration"] == 4
    assert trainer.get_extension("LogReport").log == log  # what the plots draw


def test_without_a_snapshot_the_log_stays_whole(tmp_path):
    trainer, _ = failing_trainer(tmp_path)
    trainer.extend(extensions.LogReport(trigger=(1, "iteration")))
    with pytest.raises(StepFailed):
        trainer.run()
    assert len(open(tmp_path / "log.jsonl").readlines()) == FAIL_AT - 1
    assert not (tmp_path / "log.failed.jsonl").exists()
