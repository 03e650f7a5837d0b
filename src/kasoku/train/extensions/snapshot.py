"""Snapshot: the trainer's whole state, written atomically (see ``kasoku.train.snapshot``)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kasoku.distributed.fsdp import is_sharded
from kasoku.train.reporter import PRIORITY_SNAPSHOT
from kasoku.train.run_dir import SNAPSHOT
from kasoku.train.snapshot import remove_snapshot, save_sharded_snapshot, save_snapshot


class Snapshot:
    """Writes ``trainer.state_dict()`` to ``out/filename`` when its trigger fires; the trainer
    also calls ``write_snapshot`` on SIGINT/SIGTERM.

    It runs last (``PRIORITY_SNAPSHOT``) so the state includes what every other extension did
    at this iteration. ``filename`` may contain ``{iteration}`` and ``{epoch}``
    (``"snapshot_iter_{iteration}.pt"``); then the ``keep`` newest files are kept and older
    ones deleted (only in the run's own folder: a run resumed into a new folder never touches
    the snapshots of the folder it came from). A fixed name is simply replaced each time.
    ``at_end``: also write on the run's last iteration (the trainer runs ``at_end``
    extensions then), so the folder's latest snapshot is the trained model, checked finite by
    ``FailOnNonNumber`` just before.

    ``background=True`` (the default) copies the state to host memory and writes the file on
    a background thread, so training goes on while the bytes reach the disk. Device tensors
    are copied into pinned memory without a host sync, in stream order (the steps queued after
    the snapshot cannot change them before they are copied); the thread waits for the copies
    before it writes, so taking a snapshot does not make the host wait for the GPU. One write
    is in flight at a time; the next snapshot, ``finalize`` and an interrupt wait for it, and
    a failed write is raised there. The file is still written atomically: a crash mid-write
    leaves the previous snapshot.

    A sharded model (``--shard``) is written as a folder per snapshot through
    ``torch.distributed.checkpoint``, ``snapshot_iter_N.dcp``, by every worker, in the
    foreground (``kasoku.train.snapshot.save_sharded_snapshot``).
    """
    trigger = (1, "epoch")
    priority = PRIORITY_SNAPSHOT
    name = "Snapshot"

    def __init__(self, trigger=(1, "epoch"), filename: str = SNAPSHOT,
                 keep: int = 1, background: bool = True, at_end: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.trigger, self.filename, self.keep = trigger, filename, keep
        self.background, self.at_end = background, at_end
        self._written: list[str] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def __call__(self, trainer) -> None:
        self._write(trainer, wait=not self.background)

    def write_snapshot(self, trainer) -> Path:
        """Write now and wait until the file is complete; returns the path written."""
        return self._write(trainer, wait=True)

    def _write(self, trainer, wait: bool) -> Path:
        self.wait()
        u = trainer.updater
        if is_sharded(getattr(trainer, "model", None)):
            return self._write_sharded(trainer)
        path = trainer.out / self.filename.format(iteration=u.iteration, epoch=u.epoch)
        # File names, not paths: what is deleted is in this run's folder, whatever the folder
        # the snapshots written before a resume were in.
        if path.name not in self._written:
            self._written.append(path.name)
        stale, self._written = self._written[:-self.keep], self._written[-self.keep:]
        stale = [trainer.out / name for name in stale]
        # The list is updated before the state is taken so the snapshot knows about itself.
        state = trainer.state_dict()  # in a data-parallel run, every worker takes part
        if not getattr(trainer, "writer", True):  # worker 0 writes it
            trainer.last_snapshot_iteration = u.iteration
            return path
        copies = []
        state = _host_copy(state, copies)
        trainer.last_snapshot_iteration = u.iteration
        copied = None
        if copies:  # device tensors: their copies are queued on these devices' streams
            copied = [torch.cuda.Event() for _ in copies]
            for event, device in zip(copied, copies):
                event.record(torch.cuda.current_stream(device))
        if wait:
            _save(state, path, stale, copied)
            return path
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kasoku-snapshot")
        self._pending = self._pool.submit(_save, state, path, stale, copied)
        return path

    def _write_sharded(self, trainer) -> Path:
        """A sharded model's snapshot: a folder per snapshot, ``snapshot_iter_N.dcp``, written
        by every worker at once and in the foreground (the shards are this step's tensors);
        the ``keep`` newest are kept."""
        u = trainer.updater
        path = trainer.out / f"snapshot_iter_{u.iteration}.dcp"
        if path.name not in self._written:
            self._written.append(path.name)
        stale, self._written = self._written[:-self.keep], self._written[-self.keep:]
        save_sharded_snapshot(trainer.state_dict(), path, writer=getattr(trainer, "writer",
                                                                          True))
        trainer.last_snapshot_iteration = u.iteration
        if getattr(trainer, "writer", True):
            for name in stale:
                remove_snapshot(trainer.out / name)
        return path

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def finalize(self, trainer) -> None:
        """Wait for the write in flight, on every path. After a failure nothing new is written
        (the state that failed may be diverged): the last snapshot is the last good state."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def state_dict(self) -> dict:
        return {"written": list(self._written)}

    def load_state_dict(self, state: dict) -> None:
        self._written = [Path(p).name for p in state["written"]]


def _save(state: dict, path: Path, stale: list[str], copied=None) -> None:
    for event in copied or ():
        event.synchronize()  # the pinned copies hold the values now
    save_snapshot(state, path)
    for old in stale:  # a sharded snapshot (a folder) too, where a run resumed from one
        remove_snapshot(old)


def _host_copy(state, copies: list):
    """A copy of ``state`` that training cannot change any more: tensors cloned into host
    memory (host tensors cloned, since the step updates them in place; CUDA tensors copied
    into pinned memory on their device's current stream, asynchronously: their devices are
    appended to ``copies``, and the copies are complete once that stream gets there)."""
    if isinstance(state, torch.Tensor):
        t = state.detach()
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        if t.device not in copies:
            copies.append(t.device)
        return host
    if isinstance(state, dict):
        return {k: _host_copy(v, copies) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(v, copies) for v in state)
    return state
