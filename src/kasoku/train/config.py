"""``TrainConfig``: the settings of one training run (epochs, batch, learning rate, optimizer,
seed, device, output folder, log and snapshot intervals, loader, CPU threads). Each component
takes its own small config plus runtime objects; nothing receives an argparse namespace. The
field docstrings are the command line's help texts (``kasoku.cli``)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag

Optimizer = Literal["sgd", "momentum", "adam", "adamw", "lars", "lamb", "kfac"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
"""The optimizers ``kasoku.optim.make_optimizer`` builds by name."""


@dataclass
class TrainConfig:
    epochs: float | None = None
    """Epochs to train, fractions allowed (default: the workload's recipe)."""
    batch_size: int | None = None
    """Samples per step (default: the workload's recipe)."""
    lr: float | None = None
    """Learning rate (default: the workload's recipe)."""
    grad_clip: float | None = None
    """Clip the gradients' global L2 norm to this before each update (GPT-2's recipe: 1.0);
    the norm before clipping is logged as main/grad_norm (default: the workload's recipe:
    gpt's 1.0, none for the others)."""
    optimizer: Optimizer | None = None
    """sgd | momentum | adam | lars | lamb | kfac (K-FAC preconditioning Linear and Conv2d
    layers in front of momentum SGD; see the --kfac-* settings) (default: the workload's
    recipe)."""
    seed: int | None = None
    """Seed for the weights, the data order and augmentation (default: 0)."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    out: Path | None = None
    """Folder for log.jsonl, snapshots and plots (default: a new folder
    runs/train-WORKLOAD-DATE-TIME). A folder that holds another run is refused unless
    overwrite is set."""
    overwrite: bool = False
    """Replace the run files (log, snapshots, plots) a previous run left in the output folder."""
    log_interval: int | None = None
    """Iterations between log lines (default: once per epoch)."""
    snapshot_interval: int | None = None
    """Iterations between snapshots (default: once per epoch, and on an interrupt)."""
    loader: str = "serial"
    """Which loader makes the batches, KIND or KIND:N (see `kasoku.data.registry`)."""
    prefetch: int | None = None
    """Batches the loader keeps in flight ahead of the training step: per worker for
    multiprocess and gpu-jpeg-procs (default 2), in all for threads (2) and gpu-jpeg (3).
    The serial and device loaders make a batch when asked for one."""
    loader_cores: bool = True
    """On a CPU, give the loader's worker processes or threads (multiprocess, threads) cores
    of their own and PyTorch's threads the rest, each side pinned to its cores (the workers
    get one core each, at most a quarter of them, none below 4 cores; with --threads T the
    step keeps T cores and the workers get the others)."""
    threads: int | None = None
    """CPU threads for PyTorch's operators (default: one per core, or the workload's choice;
    1 suits tiny models such as sine-lstm, above all when other jobs share the cores)."""
    progress: bool = True
    """Show a progress bar with rate and ETA."""

    def check(self) -> None:
        """Refuse values no run can use (``ConfigError`` naming the setting)."""
        if self.epochs is not None:
            _positive_number(flag("train.epochs"), self.epochs)
        if self.lr is not None:
            _positive_number(flag("train.lr"), self.lr)
        if self.grad_clip is not None:
            _positive_number(flag("train.grad_clip"), self.grad_clip)
        for name, value in ((flag("train.batch_size"), self.batch_size),
                            (flag("train.threads"), self.threads),
                            (flag("train.log_interval"), self.log_interval),
                            (flag("train.snapshot_interval"), self.snapshot_interval),
                            (flag("train.prefetch"), self.prefetch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        most = max_threads()
        if self.threads is not None and self.threads > most:
            raise ConfigError(f"{flag('train.threads')} must be at most {most} (4 x the cores "
                              f"here), got {self.threads}")


def max_threads() -> int:
    """The most CPU threads a run may ask for: 4 x this machine's cores (more only slows
    PyTorch down, and OpenMP fails past a few thousand)."""
    return 4 * (os.cpu_count() or 1)


def _positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive, finite number, got {value!r}")
