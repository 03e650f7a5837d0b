"""Chainer-style training: ``Trainer`` + extensions + stateless triggers + atomic snapshots."""
from kasoku.train import extensions
from kasoku.train.extensions import (
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
)
from kasoku.train.reporter import (
                                     PRIORITY_EDITOR,
                                     PRIORITY_LOG,
                                     PRIORITY_READER,
                                     PRIORITY_SNAPSHOT,
                                     PRIORITY_WRITER,
                                     DictSummary,
                                     Reporter,
)
from kasoku.train.snapshot import SnapshotError, load_snapshot, save_snapshot
from kasoku.train.step import PlainUpdate, StandardStep, Updater
from kasoku.train.trainer import Trainer, TrainingInterrupted
from kasoku.train.triggers import IntervalTrigger, ManualScheduleTrigger, get_trigger

__all__ = ["CosineLR", "DictSummary", "Evaluator", "FailOnNonNumber", "IntervalTrigger",
           "LinearWarmup", "LogReport", "ManualScheduleTrigger", "PRIORITY_EDITOR",
           "PRIORITY_LOG", "PlainUpdate", "PRIORITY_READER", "PRIORITY_SNAPSHOT", "PRIORITY_WRITER",
           "PlotReport", "PrintReport", "ProgressBar", "Reporter", "Snapshot", "SnapshotError",
           "StandardStep", "StepLR", "Trainer", "TrainingInterrupted", "Updater", "extensions",
           "get_trigger", "load_snapshot", "save_snapshot"]
