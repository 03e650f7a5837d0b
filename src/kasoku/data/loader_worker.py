"""What runs inside a ``ProcessLoader`` worker process (``kasoku.data.parallel_loader``):
the loop that turns ``(tag, epoch, indices)`` tasks into batches, the sending back of errors
the main process can unpickle, and the pinning of a worker (process or thread) to its
CPUs."""
from __future__ import annotations

import collections
import os
import pickle
import queue
import signal
import traceback
import warnings

import torch

from kasoku.data.bad_files import BadFileList
from kasoku.data.loader import _stack


def worker_loop(dataset, tasks, results, cpus=None) -> None:
    """One worker: ``(tag, epoch, indices)`` in, ``(tag, batch, error, new bad files)`` out
    (the bad files met since the last batch, as ``(path, reason)`` pairs), until ``None``. A
    dataset with ``start_batch(indices) -> handle`` and ``finish_batch(handle) -> batch`` has
    the next queued batch started (its files read, say) before the current one is finished, so
    the two overlap. ``cpus``: pinned there first."""
    pin_here(cpus)  # first: the threads torch starts here inherit the mask
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the main process warns about the first bad file
    set_epoch = getattr(dataset, "set_epoch", None)
    staged = hasattr(dataset, "start_batch")
    bad_files = getattr(dataset, "bad_files", None)
    if not isinstance(bad_files, BadFileList):
        bad_files = BadFileList()  # none to report
    sent = 0  # bad files reported so far
    ahead: collections.deque = collections.deque()  # (tag, epoch, handle or error)

    def start(task):
        tag, epoch, indices = task
        try:
            if set_epoch is not None:
                set_epoch(epoch)
            handle = dataset.start_batch(indices) if staged else indices
            return tag, epoch, handle, None
        except Exception as exc:  # sent back and raised in the main process
            return tag, epoch, None, _portable(exc)

    stopping = False
    while ahead or not stopping:
        if not ahead:
            task = tasks.get()
            if task is None:
                break
            ahead.append(start(task))
        if staged and not stopping:
            try:
                task = tasks.get_nowait()
            except queue.Empty:
                pass
            else:
                if task is None:
                    stopping = True
                else:
                    ahead.append(start(task))
        tag, epoch, handle, error = ahead.popleft()
        batch = None
        if error is None:
            try:
                if set_epoch is not None:
                    set_epoch(epoch)
                batch = tuple(dataset.finish_batch(handle) if staged
                              else _fetch(dataset, handle))
            except Exception as exc:  # sent back and raised in the main process
                error = _portable(exc)
        bad = [(r.path, r.reason) for r in bad_files.since(sent)]
        sent += len(bad)
        results.put((tag, batch, error, bad))


def _fetch(dataset, indices: list[int]):
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(torch.tensor(indices, dtype=torch.int64))
    return tuple(_stack(field) for field in zip(*(dataset[i] for i in indices)))


def _portable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"loader worker failed:\n{traceback.format_exc()}")


def cpu_list(cpus) -> list[int] | None:
    """``worker_cpus`` as a sorted list of CPU ids (None stays None); ``ValueError`` for an
    empty one or a negative id."""
    if cpus is None:
        return None
    cpus = sorted({int(c) for c in cpus})
    if not cpus or cpus[0] < 0:
        raise ValueError(f"worker_cpus must be CPU ids >= 0, got {cpus!r}")
    return cpus


def pin_here(cpus) -> None:
    """Pin the calling thread (a worker process's first thread; the threads it starts inherit
    the mask) to ``cpus``, where given; where the affinity API is missing or refuses, it runs
    where it was."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):
            pass
