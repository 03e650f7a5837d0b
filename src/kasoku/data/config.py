"""``DataConfig``: which data a workload trains on (real files, a download, or generated
samples of the real shapes) and how strictly bad samples are treated. The field docstrings are
the command line's help texts (``kasoku.cli``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class DataConfig:
    root: Path | None = None
    """Folder holding the real dataset (the workload's error message says what it must hold)."""
    synthetic: bool = False
    """Train on generated data of the real shapes (no files needed); on a GPU its samples
    are held on the device (the device loader) unless --loader names another."""
    synthetic_train_size: int | None = None
    """Number of synthetic training samples (default: the workload's)."""
    synthetic_val_size: int | None = None
    """Number of synthetic validation samples (default: the workload's)."""
    download: bool = False
    """Fetch the real dataset into the data folder from its official URL (md5-checked) when it
    is missing."""
    cache: Path | None = None
    """Folder for data derived from the dataset, such as a text corpus tokenized once
    (default: $KASOKU_CACHE, else $XDG_CACHE_HOME/kasoku, else ~/.cache/kasoku)."""
    strict: bool = False
    """Make the first bad sample (a corrupt image) an error instead of a skipped, counted
    warning."""
