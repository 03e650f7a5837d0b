"""The names of a training run's snapshots in its folder, said once.

The training layer owns them: ``kasoku.train.run_dir`` lists and finds a run's snapshots,
``kasoku.train.snapshot`` and its extension write them. They live here, in the ground layer,
so that the launcher (``kasoku.distributed.launch``, a layer below training) finds a run's
snapshot by the same names it was written under.
"""
from __future__ import annotations

from pathlib import Path

LATEST = "snapshot_latest.pt"
"""The snapshot a run writes by default, replaced each time, and the one ``--resume`` of a
run folder takes first."""
FILES = "snapshot_*.pt"
"""Every snapshot file of a run (``LATEST``, ``snapshot_iter_N.pt``...)."""
SHARDED = "snapshot_*.dcp"
"""Every sharded snapshot of a run: folders, each with its ``TRAINER_FILE``."""
TRAINER_FILE = "trainer.pt"
"""In a sharded snapshot's folder: the trainer's state but the model and the optimizer."""


def is_sharded_snapshot(path) -> bool:
    """Whether ``path`` is a sharded snapshot's folder (one that holds a ``TRAINER_FILE``)."""
    return (Path(path) / TRAINER_FILE).is_file()


def snapshots(folder) -> list[Path]:
    """The snapshots in a run's ``folder``: its ``FILES`` that are files and its ``SHARDED``
    folders that are complete (``is_sharded_snapshot``); none when ``folder`` is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [*(p for p in folder.glob(FILES) if p.is_file()),
            *filter(is_sharded_snapshot, folder.glob(SHARDED))]
