import io
import json
import math
import os
import signal

import pytest
import torch
from torch import nn

from kasoku.core.errors import ConfigError
from kasoku.data.base import ArrayDataset
from kasoku.data.loader import SerialLoader
from kasoku.train import (
    CosineLR,
    Evaluator,
    FailOnNonNumber,
    LinearWarmup,
    LogReport,
    PlotReport,
    PrintReport,
    ProgressBar,
    Snapshot,
    StepLR,
    Trainer,
    TrainingInterrupted,
    load_snapshot,
)
from kasoku.train.extensions import NonFiniteError


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def make_trainer(tmp_path, epochs=3, n=256, batch_size=32, lr=1e-2, metric=accuracy, **kw):
    torch.manual_seed(0)
    x = torch.randn(n, 8)
    dataset = ArrayDataset(x, (x[:, 0] + x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    trainer = Trainer(model, optimizer, SerialLoader(dataset, batch_size, seed=0),
                      nn.functional.cross_entropy, metric_fn=metric,
                      stop_trigger=(epochs, "epoch"), out=tmp_path, **kw)
    return trainer, dataset


def test_tiny_mlp_learns_and_logs(tmp_path):
    trainer, dataset = make_trainer(tmp_path, epochs=6)
    trainer.extend(Evaluator(dataset, trainer.model, nn.functional.cross_entropy, accuracy))
    trainer.extend(LogReport())
    trainer.run()
    log = trainer.get_extension("LogReport").log
    assert [e["epoch"] for e in log] == [1, 2, 3, 4, 5, 6]
    assert [e["iteration"] for e in log] == [8, 16, 24, 32, 40, 48]
    assert log[-1]["main/loss"] < 0.5 * log[0]["main/loss"]
    assert log[-1]["validation/main/accuracy"] > 0.9
    assert trainer.updater.iteration == 48 and trainer.updater.epoch == 6
    assert trainer.model.training  # the Evaluator restored train mode
    lines = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert lines == log
    assert 0 < log[0]["elapsed_time"] < log[-1]["elapsed_time"] <= trainer.updater.elapsed_time


def test_log_averages_over_the_interval(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=1, metric=None)
    seen = []
    trainer.extend(lambda t: seen.append(float(t.updater.observation["main/loss"])),
                   name="spy")
    trainer.extend(LogReport(trigger=(4, "iteration")))
    trainer.run()
    log = trainer.get_extension("LogReport").log
    assert [e["iteration"] for e in log] == [4, 8]
    assert log[0]["main/loss"] == pytest.approx(sum(seen[:4]) / 4)
    assert "main/accuracy" not in log[0]  # metric_fn=None: loss only


def test_extensions_run_by_priority_with_lifecycle(tmp_path):
    calls = []

    class Ext:
        def __init__(self, name, priority, fail=False):
            self.name, self.priority, self.fail = name, priority, fail

        def __call__(self, trainer):
            calls.append(("call", self.name))
            if self.fail and trainer.updater.iteration == 2:
                raise RuntimeError("boom")

        def initialize(self, trainer):
            calls.append(("initialize", self.name))

        def on_error(self, trainer, exc):
            calls.append(("on_error", self.name, str(exc)))

        def finalize(self, trainer):
            calls.append(("finalize", self.name))

    trainer, _ = make_trainer(tmp_path)
    trainer.extend(Ext("low", 1))
    trainer.extend(Ext("high", 50, fail=True))
    trainer.extend(Ext("mid", 10))
    with pytest.raises(RuntimeError, match="boom") as info:
        trainer.run()
    assert info.type is RuntimeError
    order = ["high", "mid", "low"]
    assert calls[:3] == [("initialize", n) for n in order]
    assert calls[3:6] == [("call", n) for n in order]
    assert calls[6] == ("call", "high")  # iteration 2 fails in the first extension
    assert calls[7:10] == [("on_error", n, "boom") for n in order]
    assert calls[10:] == [("finalize", n) for n in order]


def test_a_failing_hook_does_not_mask_the_original_error(tmp_path):
    class BadHooks:
        def __call__(self, trainer):
            raise ValueError("original")

        def on_error(self, trainer, exc):
            raise RuntimeError("on_error broke")

        def finalize(self, trainer):
            raise RuntimeError("finalize broke")

    trainer, _ = make_trainer(tmp_path)
    trainer.extend(BadHooks())
    with pytest.raises(ValueError, match="original"):
        trainer.run()


def test_print_report_columns(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=2)
    out = io.StringIO()
    trainer.extend(LogReport())
    trainer.extend(PrintReport(out=out))
    trainer.run()
    lines = out.getvalue().splitlines()
    header = lines[0].split()
    assert header == ["epoch", "main/loss", "validation/main/loss", "main/accuracy",
                      "validation/main/accuracy", "elapsed_time"]
    assert len(lines) == 3
    col = lines[0].index("main/accuracy")
    val_col = lines[0].index("validation/main/loss")
    row = lines[1]
    assert row.startswith("1 ") and row[col] != " "
    assert row[val_col:val_col + 20].strip() == ""  # no Evaluator: blank column
    assert float(row[col:].split()[0]) == pytest.approx(
        trainer.get_extension("LogReport").log[0]["main/accuracy"], rel=1e-5)


def test_fail_on_nonnumber_names_the_parameter(tmp_path):
    trainer, _ = make_trainer(tmp_path)

    def poison(t):
        if t.updater.iteration == 4:
            with torch.no_grad():
                t.model[2].bias[0] = float("nan")
    trainer.extend(poison, priority=500)
    trainer.extend(FailOnNonNumber(), trigger=(2, "iteration"))
    with pytest.raises(NonFiniteError, match=r"'2.bias'.*iteration 4"):
        trainer.run()


def test_fail_on_nonnumber_checks_the_loss(tmp_path):
    trainer, _ = make_trainer(tmp_path, lr=float("inf"))
    trainer.extend(FailOnNonNumber(), trigger=(1, "iteration"))
    with pytest.raises(NonFiniteError, match="loss|parameter"):
        trainer.run()


def lr_values(tmp_path, schedule, epochs=4):
    trainer, _ = make_trainer(tmp_path, epochs=epochs, n=40, batch_size=10, lr=0.1)
    lrs = []
    trainer.extend(schedule)
    trainer.extend(lambda t: lrs.append(t.updater.observation["lr"]), name="spy")
    trainer.run()
    return lrs


def test_lr_schedules(tmp_path):
    # 4 iterations per epoch; each value is the rate the step of that iteration used
    assert lr_values(tmp_path, StepLR(2, gamma=0.5)) == pytest.approx([0.1] * 8 + [0.05] * 8)
    cosine = lr_values(tmp_path, CosineLR(4, min_lr=0.01))
    assert cosine == pytest.approx([0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * i / 16))
                                    for i in range(16)])
    warm = lr_values(tmp_path, LinearWarmup(1, inner=StepLR(2, gamma=0.5)))
    assert warm == pytest.approx([0.025, 0.05, 0.075, 0.1] + [0.1] * 4 + [0.05] * 8)


def test_progress_bar_plain_lines(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=1)
    out = io.StringIO()
    trainer.extend(ProgressBar(plain_interval=0.0, out=out))
    trainer.run()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("iteration 8/8  epoch 1.00") and "it/s" in last
    assert "samples/s" in last and "ETA 0:00:00" in last


def test_plot_report_writes_a_png(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=2)
    trainer.extend(LogReport())
    trainer.extend(PlotReport(["main/loss"], filename="loss.png"))
    trainer.run()
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_step_fn_is_replaceable(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=1)
    default = trainer.step_fn
    calls = []

    def wrapped(model, batch, optimizer):
        calls.append(len(batch[1]))
        return default(model, batch, optimizer)
    trainer.step_fn = wrapped
    trainer.run()
    assert calls == [32] * 8


def test_sigint_writes_a_snapshot_and_raises(tmp_path, capsys):
    trainer, _ = make_trainer(tmp_path, epochs=3)
    trainer.extend(Snapshot(filename="snap.pt"))
    trainer.extend(lambda t: t.updater.iteration == 5 and os.kill(os.getpid(), signal.SIGINT),
                   name="sender")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.run()
    assert info.value.exit_code == 130 and info.value.iteration == 5
    assert signal.getsignal(signal.SIGINT) is before
    path = tmp_path / "snap.pt"
    assert info.value.snapshot == path
    assert load_snapshot(path)["updater"]["iteration"] == 5
    assert str(info.value) == f"interrupted at iteration 5; resume with: --resume {path}"


def test_dict_summary_is_lazy_and_resumes_exactly(monkeypatch):
    from kasoku.train.reporter import DictSummary
    monkeypatch.setattr(DictSummary, "FOLD", 4)
    values = list(torch.rand(11, generator=torch.Generator().manual_seed(0)).unbind())
    whole, first = DictSummary(), DictSummary()
    for i, v in enumerate(values):
        obs = {"loss": v, "lr": 0.1 * i, "text": "ignored", "vector": torch.ones(3)}
        whole.add(obs)
        if i < 6:
            first.add(obs)
    resumed = DictSummary()
    resumed.load_state_dict(first.state_dict())
    for i, v in enumerate(values[6:], start=6):
        resumed.add({"loss": v, "lr": 0.1 * i})
    means = whole.compute_mean()
    assert means == resumed.compute_mean()
    assert set(means) == {"loss", "lr"}
    assert means["loss"] == pytest.approx(float(torch.stack(values).mean()))
    assert means["lr"] == pytest.approx(0.5)


def test_evaluator_weights_by_batch_size_and_restores_mode():
    x = torch.arange(10, dtype=torch.float32)[:, None]
    dataset = ArrayDataset(x, torch.zeros(10, dtype=torch.long))
    model = nn.Identity()
    model.eval()
    evaluator = Evaluator(dataset, model, lambda out, t: out.mean(), batch_size=4)
    result = evaluator.evaluate()
    assert float(result["main/loss"]) == pytest.approx(4.5)  # batches of 4, 4, 2
    assert result["main/accuracy"] is None
    assert not model.training
    assert float(evaluator.evaluate()["main/loss"]) == pytest.approx(4.5)  # rewound
    with pytest.raises(ValueError, match="repeat=False"):
        Evaluator(SerialLoader(dataset, 4), model, nn.functional.cross_entropy)


def test_snapshot_keeps_the_newest_files(tmp_path):
    trainer, _ = make_trainer(tmp_path, epochs=1)
    trainer.extend(Snapshot(trigger=(2, "iteration"), filename="snap_{iteration}.pt", keep=2))
    trainer.run()
    assert sorted(p.name for p in tmp_path.glob("snap_*.pt")) == ["snap_6.pt", "snap_8.pt"]
    assert load_snapshot(tmp_path / "snap_8.pt")["updater"]["iteration"] == 8


def test_torch_scheduler_is_stepped_and_resumed(tmp_path):
    from kasoku.train import ManualScheduleTrigger

    def build(stop, out):
        trainer, _ = make_trainer(tmp_path, epochs=1, lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda i: 0.5 ** i)
        trainer = Trainer(trainer.model, trainer.optimizer, trainer.train_loader,
                          nn.functional.cross_entropy, stop_trigger=(stop, "iteration"),
                          out=out, scheduler=scheduler)
        # No snapshot at the end: the run of 4 iterations stands for one killed after 3.
        trainer.extend(Snapshot(trigger=ManualScheduleTrigger(3, "iteration"), at_end=False))
        lrs = []
        trainer.extend(lambda t: lrs.append(t.observation["lr"]), name="spy")
        return trainer, lrs

    whole, whole_lrs = build(6, tmp_path / "whole")
    whole.run()
    assert whole_lrs == pytest.approx([0.1 * 0.5 ** i for i in range(6)])
    build(4, tmp_path / "split")[0].run()
    resumed, lrs = build(6, tmp_path / "split")
    resumed.run(resume=tmp_path / "split" / "snapshot_latest.pt")
    assert lrs == whole_lrs[3:]
    assert resumed.scheduler.last_epoch == whole.scheduler.last_epoch == 6


@pytest.mark.parametrize("interval, expected", [
    (3600, [3]),         # no redraw within the first interval; the final one in finalize
    (0.0, [1, 2, 3]),    # each new log entry, and nothing more at the end
])
def test_plot_report_redraws_at_most_every_interval_and_at_the_end(tmp_path, monkeypatch,
                                                                    interval, expected):
    trainer, _ = make_trainer(tmp_path, epochs=3)
    trainer.extend(LogReport())
    plot = PlotReport(["main/loss"], filename="loss.png", min_interval_s=interval)
    drawn = []
    monkeypatch.setattr(plot, "draw", lambda log, path: drawn.append(len(log)))
    trainer.extend(plot)
    trainer.run()
    assert drawn == expected


def test_a_fresh_run_refuses_a_folder_holding_another_and_overwrite_replaces_it(tmp_path):
    first, _ = make_trainer(tmp_path, epochs=1)
    first.extend(LogReport())
    first.run()
    log = (tmp_path / "log.jsonl").read_text()
    second, _ = make_trainer(tmp_path, epochs=1, lr=0.5)
    second.extend(LogReport())
    with pytest.raises(ConfigError, match="holds a previous run"):
        second.run()
    assert (tmp_path / "log.jsonl").read_text() == log  # the first run's log is untouched
    third, _ = make_trainer(tmp_path, epochs=1, lr=0.5, overwrite=True)
    third.extend(LogReport())
    third.run()
    assert (tmp_path / "log.jsonl").read_text() != log


def test_a_trainer_runs_again_in_its_own_folder_with_a_right_table(tmp_path):
    out = io.StringIO()
    trainer, _ = make_trainer(tmp_path, epochs=1.5)
    trainer.extend(LogReport())
    trainer.extend(PrintReport(["epoch", "iteration"], out=out))
    trainer.run()
    trainer.stop_trigger = trainer.stop_trigger.__class__(3, "epoch")
    trainer.run()  # its own files: not refused
    rows = [line.split() for line in out.getvalue().splitlines()[1:]]
    assert rows == [["1", "8"], ["1.5", "12"], ["2", "16"], ["3", "24"]]
    lines = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in lines] == [8, 16, 24]


def test_a_resume_into_a_folder_holding_another_run_is_refused(tmp_path):
    first, _ = make_trainer(tmp_path / "a", epochs=1)
    first.extend(Snapshot())
    first.run()
    other, _ = make_trainer(tmp_path / "b", epochs=1)
    other.extend(Snapshot())
    other.run()
    again, _ = make_trainer(tmp_path / "b", epochs=2)
    again.extend(Snapshot())
    with pytest.raises(ConfigError, match="holds a previous run.*run\\(resume=SNAPSHOT\\)"):
        again.run(resume=tmp_path / "a" / "snapshot_latest.pt")
