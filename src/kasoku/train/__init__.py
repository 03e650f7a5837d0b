"""Chainer-style training: ``Trainer`` + extensions + stateless triggers + atomic snapshots.

The names below are imported on first use (PEP 562), as ``kasoku``'s are: the package's
torch-free modules (``config``, ``run_dir``) load without torch, so the command line can build
its parser from them."""
from __future__ import annotations

from kasoku.core.lazy_exports import lazy_exports

__all__ = ["CosineLR", "DictSummary", "Evaluator", "FailOnNonNumber", "IntervalTrigger",
           "LinearWarmup", "LogReport", "ManualScheduleTrigger", "PRIORITY_EDITOR",
           "PRIORITY_LOG", "PlainUpdate", "PRIORITY_READER", "PRIORITY_SNAPSHOT", "PRIORITY_WRITER",
           "PlotReport", "PrintReport", "ProgressBar", "Reporter", "Snapshot", "SnapshotError",
           "StandardStep", "StepLR", "Trainer", "TrainingInterrupted", "Updater", "extensions",
           "get_trigger", "load_snapshot", "save_snapshot"]
__getattr__, __dir__ = lazy_exports(globals(), {
    **dict.fromkeys(["CosineLR", "Evaluator", "FailOnNonNumber", "LinearWarmup", "LogReport",
                     "PlotReport", "PrintReport", "ProgressBar", "Snapshot", "StepLR"],
                    "kasoku.train.extensions"),
    **dict.fromkeys(["PRIORITY_EDITOR", "PRIORITY_LOG", "PRIORITY_READER", "PRIORITY_SNAPSHOT",
                     "PRIORITY_WRITER", "DictSummary", "Reporter"], "kasoku.train.reporter"),
    **dict.fromkeys(["SnapshotError", "load_snapshot", "save_snapshot"],
                    "kasoku.train.snapshot"),
    **dict.fromkeys(["PlainUpdate", "StandardStep", "Updater"], "kasoku.train.step"),
    **dict.fromkeys(["Trainer", "TrainingInterrupted"], "kasoku.train.trainer"),
    **dict.fromkeys(["IntervalTrigger", "ManualScheduleTrigger", "get_trigger"],
                    "kasoku.train.triggers"),
})
