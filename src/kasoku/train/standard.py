"""The standard extensions of a ``kasoku train`` run (``kasoku.commands.train.build_trainer``): the
log, the printed table and plots, snapshots, the progress bar, and the learning-rate
schedule of the workload's recipe. ``workload`` is a ``kasoku.workloads.Workload``."""
from __future__ import annotations

import math

from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.train import extensions as ext
from kasoku.train.config import TrainConfig
from kasoku.train.trainer import Trainer
from kasoku.train.triggers import IntervalTrigger

ROUNDING_NOTED = 0.05
"""A run that trains this fraction more iterations than ``--epochs`` asks for says so."""


def log_trigger(train: TrainConfig):
    """When the log takes a line: every ``--log-interval`` iterations, else every epoch."""
    return (train.log_interval, "iteration") if train.log_interval else (1, "epoch")


def snapshot_trigger(train: TrainConfig):
    """When a snapshot is taken: every ``--snapshot-interval`` iterations, else every epoch."""
    return (train.snapshot_interval, "iteration") if train.snapshot_interval else (1, "epoch")


def extend_reports(trainer: Trainer, workload, train: TrainConfig, has_val: bool) -> None:
    """Worker 0's reports: the log (every ``--log-interval`` iterations, else every epoch,
    with the samples trained on so far in the workload's unit: gpt's ``tokens``), the
    printed table, skipped samples and their list (``bad_files.jsonl``), the stop on a
    non-finite loss, the loss and accuracy plots, snapshots and the progress bar."""
    every = log_trigger(train)
    trainer.extend(ext.LogReport(trigger=every, unit=workload.sample_unit,
                                 units_per_sample=workload.units_per_sample))
    trainer.extend(ext.PrintReport(print_entries(workload, has_val)))
    trainer.extend(ext.SkippedReport())
    trainer.extend(EpochsRounded())
    trainer.extend(ext.BadFileLog())
    trainer.extend(ext.FailOnNonNumber(), trigger=every)
    # Against the progress in epochs, fractions included: log lines every N iterations
    # fall between the epochs.
    trainer.extend(ext.PlotReport(["main/loss", "validation/main/loss"], x_key="epoch_detail",
                                  filename="loss.png", title=f"{workload.name}: loss",
                                  xlabel="epoch", ylabel="loss", log_y=True),
                   trigger=every)
    if workload.has_accuracy:
        trainer.extend(ext.PlotReport(["main/accuracy", "validation/main/accuracy"],
                                      x_key="epoch_detail", filename="accuracy.png",
                                      y_range=(0, 1), title=f"{workload.name}: accuracy",
                                      xlabel="epoch", ylabel="accuracy"),
                       trigger=every)
    trainer.extend(ext.Snapshot(), trigger=snapshot_trigger(train))
    if train.progress:
        trainer.extend(ext.ProgressBar(unit=workload.sample_unit,
                                       units_per_sample=workload.units_per_sample))


class EpochsRounded:
    """Says once, as the run starts, that the iterations it will train are noticeably more
    than ``--epochs`` asks for (``rounded_epochs``)."""
    trigger = None  # never fires: its one word is said in initialize
    name = "EpochsRounded"

    def initialize(self, trainer) -> None:
        note = rounded_epochs(trainer.stop_trigger, trainer.updater.batches_per_epoch)
        if note:
            warn_once(note)

    def __call__(self, trainer) -> None:
        pass


def rounded_epochs(stop, batches_per_epoch: int) -> str | None:
    """What to say when a stop after ``stop``'s epochs (an ``IntervalTrigger`` in epochs;
    any other stop: None) trains ``ROUNDING_NOTED`` or more iterations than asked: a run
    stops after the whole iteration that reaches it, so ``--epochs 0.01`` of an epoch of 4
    iterations trains one iteration, 0.25 epochs. None when the rounding is smaller."""
    if not (isinstance(stop, IntervalTrigger) and stop.unit == "epoch"):
        return None
    asked = stop.period * batches_per_epoch
    iterations = math.ceil(asked - 1e-9)  # where the stop fires (float rounding absorbed)
    if iterations <= asked * (1 + ROUNDING_NOTED):
        return None
    return (f"{flag('train.epochs')} {stop.period:g} asks for {asked:.3g} iterations "
            f"({batches_per_epoch} make an epoch here); a run trains whole iterations, so this one "
            f"trains {iterations} iteration{'s' if iterations > 1 else ''} "
            f"({iterations / batches_per_epoch:.4g} epochs)")


def schedules(recipe, epochs: float, warmup_epochs: float) -> list:
    """The learning-rate schedule of ``recipe.schedule`` over ``epochs``, behind a linear
    warm-up of ``warmup_epochs`` when that is positive."""
    if recipe.schedule == "none":
        inner = None
    elif recipe.schedule == "cosine":
        inner = ext.CosineLR(total_epochs=epochs)
    elif recipe.schedule == "step":
        inner = ext.StepLR(step_size_epochs=max(1, int(epochs * 0.3)), gamma=0.1)
    else:
        raise ConfigError(f"unknown schedule {recipe.schedule!r}; use none, step or cosine")
    if warmup_epochs > 0:
        return [ext.LinearWarmup(warmup_epochs, inner=inner)]
    return [inner] if inner is not None else []


def print_entries(workload, has_val: bool) -> list[str]:
    """The columns of the printed table (seed 001's log), less those the run has not."""
    entries = ["epoch", "main/loss", "validation/main/loss", "main/accuracy",
               "validation/main/accuracy", "elapsed_time"]
    if not workload.has_accuracy:
        entries = [e for e in entries if not e.endswith("accuracy")]
    if not has_val:
        entries = [e for e in entries if not e.startswith("validation/")]
    return entries
