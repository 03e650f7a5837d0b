"""What the workload modules share about their datasets without loading them (and without
torch, so that the workloads' classes load without it): the synthetic sizes, the error for a
missing real dataset, CIFAR-10's files and its holdout protocol's size."""
from __future__ import annotations

from pathlib import Path

from kasoku.core.errors import DataError
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig


def synthetic_sizes(data: DataConfig, default_sizes: tuple[int, int]) -> tuple[int, int]:
    """``(n_train, n_val)``: the config's sizes where set, else the workload's defaults."""
    n_train = data.synthetic_train_size if data.synthetic_train_size is not None \
        else default_sizes[0]
    n_val = data.synthetic_val_size if data.synthetic_val_size is not None else default_sizes[1]
    if n_train < 1 or n_val < 1:
        raise DataError("synthetic data needs at least one training and one validation sample, "
                        f"got {n_train} and {n_val}; pass a positive "
                        f"{flag('data.synthetic_train_size')}")
    return n_train, n_val


def require_root(data: DataConfig, workload: str, contents: str, how_to_get: str) -> Path:
    """``data.root`` as a Path, or a ``DataError`` saying what ``--data DIR`` must hold, how to
    get it, and that ``--synthetic`` runs without it."""
    if data.root is not None:
        return Path(data.root)
    raise DataError(f"workload {workload} trains on real data: pass {flag('data.root')} DIR, where "
                    f"DIR holds {contents}. {how_to_get} Or pass {flag('data.synthetic')} to train "
                    "on generated data of the same shapes (for throughput work, or on machines "
                    "without the dataset).")


CIFAR10_CONTENTS = ("cifar-10-batches-bin/ (the binary version of CIFAR-10: data_batch_1.bin .. "
                    "data_batch_5.bin)")
CIFAR10_HOW_TO_GET = (f"Get it with `kasoku data download cifar10 {flag('data_download.out')} DIR` "
                      f"(or add {flag('data.download')}).")


CIFAR10_HOLDOUT_TRAIN = 40_000
"""Samples in an epoch of the CIFAR-10 holdout protocol: training batches 1-4 (batch 5
validates)."""
