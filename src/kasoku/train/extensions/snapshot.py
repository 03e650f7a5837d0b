"""Snapshot: the trainer's whole state, written atomically (see ``kasoku.train.snapshot``)."""
from __future__ import annotations

from pathlib import Path

from kasoku.train.reporter import PRIORITY_SNAPSHOT
from kasoku.train.snapshot import save_snapshot


class Snapshot:
    """Writes ``trainer.state_dict()`` to ``out/filename`` when its trigger fires; the trainer
    also calls ``write_snapshot`` on SIGINT/SIGTERM.

    It runs last (``PRIORITY_SNAPSHOT``) so the state includes what every other extension did
    at this iteration. ``filename`` may contain ``{iteration}`` and ``{epoch}``
    (``"snapshot_iter_{iteration}.pt"``); then the ``keep`` newest files are kept and older
    ones deleted. A fixed name is simply replaced each time.
    """
    trigger = (1, "epoch")
    priority = PRIORITY_SNAPSHOT
    name = "Snapshot"

    def __init__(self, trigger=(1, "epoch"), filename: str = "snapshot_latest.pt",
                 keep: int = 1):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.trigger, self.filename, self.keep = trigger, filename, keep
        self._written: list[str] = []

    def __call__(self, trainer) -> None:
        self.write_snapshot(trainer)

    def write_snapshot(self, trainer) -> Path:
        """Write now; returns the path written."""
        u = trainer.updater
        path = trainer.out / self.filename.format(iteration=u.iteration, epoch=u.epoch)
        if str(path) not in self._written:
            self._written.append(str(path))
        stale, self._written = self._written[:-self.keep], self._written[-self.keep:]
        # The list is updated before the state is taken so the snapshot knows about itself.
        save_snapshot(trainer.state_dict(), path)
        for old in stale:
            Path(old).unlink(missing_ok=True)
        return path

    def state_dict(self) -> dict:
        return {"written": list(self._written)}

    def load_state_dict(self, state: dict) -> None:
        self._written = list(state["written"])
