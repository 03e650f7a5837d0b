"""Trainer extensions, one per module: callables ``ext(trainer)`` with a default ``trigger``
and ``priority`` as class attributes (see docs/architecture.md)."""
from kasoku.train.extensions.bad_file_log import BadFileLog
from kasoku.train.extensions.evaluator import Evaluator
from kasoku.train.extensions.fail_on_nonnumber import FailOnNonNumber, NonFiniteError
from kasoku.train.extensions.log_report import LogReport
from kasoku.train.extensions.lr_schedule import CosineLR, LinearWarmup, LRSchedule, StepLR
from kasoku.train.extensions.plot_report import PlotReport
from kasoku.train.extensions.print_report import PrintReport
from kasoku.train.extensions.progress_bar import ProgressBar
from kasoku.train.extensions.skipped_report import SkippedReport
from kasoku.train.extensions.snapshot import Snapshot

__all__ = ["BadFileLog", "CosineLR", "Evaluator", "FailOnNonNumber", "LRSchedule", "LinearWarmup",
           "LogReport", "NonFiniteError", "PlotReport", "PrintReport", "ProgressBar",
           "SkippedReport", "Snapshot", "StepLR"]
