"""Small per-component configs. Each component takes its own config plus runtime objects;
nothing receives a whole run config or an argparse namespace."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class DataConfig:
    root: Path | None = None
    """Folder holding the real dataset (None: the workload's usual place, see its error message)."""
    synthetic: bool = False
    """Use generated data of the real shapes instead of files."""
    synthetic_train_size: int | None = None
    """Number of synthetic training samples (None: the workload's default)."""
    synthetic_val_size: int | None = None
    """Number of synthetic validation samples (None: the workload's default)."""
    download: bool = False
    """Fetch the real dataset from its official URL (md5-verified) when it is missing."""
    strict: bool = False
    """Make the first bad sample an error instead of a skipped, counted warning."""


@dataclass
class TrainConfig:
    epochs: float | None = None
    """Training length in epochs, fractions allowed (None: the workload's recipe)."""
    batch_size: int | None = None
    """Samples per step (None: the workload's recipe)."""
    lr: float | None = None
    """Learning rate (None: the workload's recipe)."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    device: str = "cpu"
    """Where to train: cpu or cuda (cuda:N for one GPU)."""
    out: Path = Path("result")
    """Folder for the log, snapshots and plots."""
    log_interval: int | None = None
    """Iterations between log lines (None: once per epoch)."""
    snapshot_interval: int | None = None
    """Iterations between snapshots (None: once per epoch, plus on interrupt)."""
    loader: str = "serial"
    """serial (batches made in the training process) | device (the whole dataset resident on
    the training device; in-memory datasets such as MNIST and CIFAR-10) | threads[:N] (samples
    decoded by N threads) | multiprocess[:N] (batches made by N worker processes) |
    gpu-jpeg[:N] (JPEG folders: N threads read the files, the GPU decodes and crops batches) |
    gpu-jpeg-procs[:N] (gpu-jpeg's work in N worker processes, batches handed over on the GPU)."""
    prefetch: int | None = None
    """Batches the loader keeps in flight ahead of the training step: per worker for
    multiprocess and gpu-jpeg-procs (default 2), in all for threads (2) and gpu-jpeg (3).
    None: those defaults. The serial and device loaders make a batch when asked for one."""
    threads: int | None = None
    """CPU threads for PyTorch's operators (None: PyTorch's default, one per core). Small
    models such as sine-lstm run faster on one thread, and far faster when other jobs share
    the cores: spinning OpenMP barriers stall on a descheduled thread."""
    progress: bool = True
    """Show a progress bar with rate and ETA."""
