"""Host loaders that decode ahead of the trainer: ``ThreadLoader`` and ``ProcessLoader``.

Both are ``SerialLoader`` with the fetching moved off the training thread: the order, the
sharding, the batches (same indices, same collation) and the ``(epoch, position)`` resume
state are ``SerialLoader``'s, so either yields exactly ``SerialLoader``'s batches.

Prefetch stays inside the current epoch: the next epoch's order is drawn (and
``set_epoch`` called) only when its first batch is asked for, as in ``SerialLoader``, so the
dataset's epoch never changes under work in flight. Work in flight is discarded when the
state moves elsewhere (``load_state_dict``, ``reset``).

Cores: ``worker_cpus`` pins each worker thread or process to those CPUs as it starts (a CPU
run gives the loader cores of its own: ``kasoku.accel.loader_cores``); None leaves them where
the main process runs.

Bad samples: a dataset that skips bad files (``ImageFolder`` without ``strict``) keeps them, with
their reasons, in ``dataset.bad_files``; ``loader.bad_file_list`` (``skipped``,
``skipped_files``, ``skipped_records``) reports them, gathered from the worker processes for
``ProcessLoader`` into a list of its own in this process (which warns about the first one).
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import queue
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling through shared memory

from kasoku.core.errors import warn_once
from kasoku.core.flags import flag
from kasoku.data.bad_files import BadFileList
from kasoku.data.loader import SerialLoader, _stack
from kasoku.data.loader_worker import cpu_list, pin_here, worker_loop

_POLL_S = 0.1
"""How often a wait for a worker's batch checks that the worker is still alive."""


class _PrefetchLoader(SerialLoader):
    """``SerialLoader`` that keeps up to ``depth`` upcoming batches in flight.

    Subclasses say how a batch is started (``_submit(epoch, position, indices) -> handle``),
    how it is awaited (``_collect(position, indices, handle) -> batch``) and how a handle is
    dropped. Where ``crosses_epochs`` (and the loader repeats), the next epoch's first batches
    are started while this epoch's last ones are still being consumed, so an epoch's end does
    not drain the pipeline: with a small folder (8 batches an epoch) the drain cost gpu-jpeg
    a tenth of its rate alone (9,913 against 10,987 images/s on an H200) and the ResNet-50
    step it fed 3 points (88% against 91% of its synthetic-data rate); with 16 worker
    processes and a 64-batch epoch, cores sat idle (13.4-13.9 of 16 busy, now 15.3).
    """

    crosses_epochs = False
    """Whether a batch of the next epoch may be started before this epoch ends: for loaders
    whose batches take their epoch from the task (not from the dataset's current epoch)."""

    def __init__(self, dataset, batch_size: int, prefetch_batches: int = 2, **kwargs):
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) \
                or prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be a whole number >= 1, got "
                             f"{prefetch_batches!r}")
        self.prefetch_batches = prefetch_batches
        self._pending: collections.deque = collections.deque()  # ((epoch, pos), indices, handle)
        self._next_order: tuple | None = None  # ((seed, shuffle, epoch), order) drawn ahead
        super().__init__(dataset, batch_size, **kwargs)

    _depth = property(lambda self: self.prefetch_batches)

    def __next__(self):
        self._start_epoch_if_needed()
        key = (self.epoch, self.position)
        if self._pending and self._pending[0][0] != key:
            self._discard()  # the state moved (resume, reset): what is in flight is not next
        self._fill()
        _, indices, handle = self._pending.popleft()
        batch = self._collect(self.position, indices, handle)
        self._advance(1)
        return batch

    def _fill(self) -> None:
        if self._pending:
            epoch, position = self._pending[-1][0]
            position += 1
        else:
            epoch, position = self.epoch, self.position
        while len(self._pending) < self._depth:
            if position == self.batches_per_epoch:
                if not (self.crosses_epochs and self.repeat):
                    return
                epoch, position = epoch + 1, 0
            order = self._order if epoch == self.epoch else self.epoch_indices(epoch)
            first = position * self.batch_size
            indices = order[first:first + self.batch_size]
            self._pending.append(((epoch, position), indices,
                                  self._submit(epoch, position, indices)))
            position += 1

    def epoch_indices(self, epoch: int):
        # The next epoch's order is drawn once, when its first batch is started ahead.
        key = (self.seed, self.shuffle, epoch)
        if self._next_order is not None and self._next_order[0] == key:
            return self._next_order[1]
        order = super().epoch_indices(epoch)
        self._next_order = (key, order)
        return order

    def _discard(self) -> None:
        while self._pending:
            self._drop(self._pending.popleft()[2])

    def _drop(self, handle) -> None:
        pass

    def reset(self) -> None:
        self._discard()
        super().reset()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._discard()

    def close(self) -> None:
        self._discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


class ThreadLoader(_PrefetchLoader):
    """``SerialLoader`` whose samples are decoded by a pool of ``num_threads`` threads.

    Pillow and PyTorch release the GIL while decoding and resizing, so per-sample decodes run
    in parallel: each sample of the next ``prefetch_batches`` batches is one pool task
    (``dataset[i]``), stacked as ``SerialLoader`` stacks them; a dataset with ``get_batch``
    makes one task per batch. ``worker_cpus``: the CPUs each pool thread pins itself to (Linux
    keeps an affinity mask per thread). Takes ``SerialLoader``'s keyword arguments.
    """

    def __init__(self, dataset, batch_size: int, num_threads: int | None = None,
                 prefetch_batches: int = 2, worker_cpus=None, **kwargs):
        self.num_threads = num_threads or self.default_threads()
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self.worker_cpus = cpu_list(worker_cpus)
        self._per_item = not hasattr(dataset, "get_batch")
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="kasoku-loader",
                                        initializer=pin_here, initargs=(self.worker_cpus,))
        super().__init__(dataset, batch_size, prefetch_batches=prefetch_batches, **kwargs)

    @staticmethod
    def default_threads() -> int:
        """Threads when none are asked for: 8, or fewer on a machine with fewer cores."""
        return min(8, os.cpu_count() or 1)

    def _submit(self, epoch, position, indices):
        if self._per_item:
            return [self._pool.submit(self.dataset.__getitem__, i) for i in indices.tolist()]
        return [self._pool.submit(self._fetch, indices)]

    def _collect(self, position, indices, handle):
        results = [f.result() for f in handle]  # re-raises a sample's exception (DataError)
        if self._per_item:
            return tuple(_stack(field) for field in zip(*results))
        return results[0]

    def _drop(self, handle) -> None:
        for future in handle:
            future.cancel()  # a started decode finishes and is ignored

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"ThreadLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"num_threads={self.num_threads}, rank={self.rank}/{self.world_size})")


class ProcessLoader(_PrefetchLoader):
    """``SerialLoader`` whose batches are made by ``num_workers`` persistent worker processes.

    Batch ``p`` of an epoch goes whole to worker ``p % num_workers`` (``dataset.get_batch`` or
    ``dataset[i]`` per sample and ``SerialLoader``'s stacking, with ``set_epoch`` called in the
    worker); each worker has its own task and result queue, so results come back in order.
    Up to ``prefetch_batches`` batches per worker are in flight.

    Start method: ``fork`` where the platform has it and CUDA is not initialized here --
    workers start in milliseconds and share the dataset copy-on-write. A process that has
    initialized CUDA (or compiled a model) runs threads whose locks a forked child inherits
    held (a forked worker died of SIGSEGV there), so then ``forkserver``: one clean server
    process, with torch already imported, forks the workers (``spawn`` instead, where each of
    16 workers imported torch itself, took 38 s to start). With ``forkserver`` or ``spawn``
    (also ``start_method="spawn"``) the dataset is pickled to each worker and must be
    picklable. Batches come back as tensors in shared memory (PyTorch's multiprocessing
    pickling: the worker writes the batch into a shared-memory segment and sends its file
    descriptor), so the main process copies nothing until it pins the batch; a float32
    ImageNet batch through a pipe instead costs the main process several copies of ~40 MB and
    caps the loader at a few cores' output. A segment is freed when its last holder
    closes it, so a killed worker leaks nothing. ``worker_cpus``: the CPUs every worker
    pins itself to as it starts.

    A worker that dies (killed, out of memory) makes the next wait for its batch raise
    ``RuntimeError`` naming the worker, its pid, the batch indices and first file; an
    exception in the dataset (``DataError`` with ``strict``) is re-raised here. ``close()``
    (also on ``with`` exit and garbage collection) stops the workers.
    """

    def __init__(self, dataset, batch_size: int, num_workers: int | None = None,
                 prefetch_batches: int = 2, pin_memory: bool = False,
                 start_method: str | None = None, worker_cpus=None, **kwargs):
        self.num_workers = num_workers or self.default_workers()
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
        self.worker_cpus = cpu_list(worker_cpus)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warn_once("pin_memory has no effect without CUDA; batches stay pageable")
        if start_method is None:
            start_method = _default_start_method()
        self.start_method = start_method
        self._workers: list = []
        self._bad = BadFileList()  # the workers' bad files, gathered here
        for record in getattr(dataset, "bad_files", None) or ():  # known before any worker
            self._bad.add(record.path, record.reason, warn=False)
        self._next_tag = 0
        super().__init__(dataset, batch_size, prefetch_batches=prefetch_batches, **kwargs)
        self._start_workers()

    _depth = property(lambda self: self.prefetch_batches * self.num_workers)
    crosses_epochs = True  # a task carries its epoch; the worker sets it before each batch

    @staticmethod
    def default_workers() -> int:
        """Workers when none are asked for: 4, or fewer on a machine with fewer cores."""
        return min(4, os.cpu_count() or 1)

    def _start_workers(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload([__name__])  # the server imports torch once
        for number in range(self.num_workers):
            tasks, results = ctx.Queue(), ctx.Queue()
            process = ctx.Process(target=worker_loop,
                                  args=(self.dataset, tasks, results, self.worker_cpus),
                                  name=f"kasoku-loader-{number}", daemon=True)
            process.start()
            self._workers.append((process, tasks, results))

    def _submit(self, epoch, position, indices):
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        self._workers[position % self.num_workers][1].put((tag, epoch, indices.tolist()))
        return tag

    def _collect(self, position, indices, tag):
        number = position % self.num_workers
        process, _, results = self._workers[number]
        while True:
            try:
                got, batch, error, bad = results.get(timeout=_POLL_S)
            except queue.Empty:
                if not process.is_alive():
                    raise self._death(number, process, indices) from None
                continue
            except (OSError, EOFError):  # a batch whose sender died before it was fetched
                if not process.is_alive():
                    raise self._death(number, process, indices) from None
                raise
            self._note_bad(bad)
            if got != tag:
                continue  # a discarded batch finished: its results are no one's
            if error is not None:
                raise error
            return tuple(self._from_wire(x) for x in batch)

    def _death(self, number, process, indices) -> RuntimeError:
        held = indices.tolist()
        samples = getattr(self.dataset, "samples", None)
        first = f"; first file {samples[held[0]][0]}" if samples is not None else ""
        return RuntimeError(
            f"loader worker {number} (pid {process.pid}) died with exit code "
            f"{process.exitcode} while making the batch of indices {held}{first}. A negative "
            f"code is the signal that killed it (-9: killed, often out of memory); fewer "
            f"{flag('train.loader')} workers or a smaller batch use less memory.")

    def _note_bad(self, records) -> None:
        for path, reason in records:
            self._bad.add(path, reason)

    bad_file_list = property(lambda self: self._bad)

    def _from_wire(self, x):
        return x.pin_memory() if self.pin_memory and isinstance(x, torch.Tensor) else x

    def close(self) -> None:
        super().close()
        workers, self._workers = getattr(self, "_workers", []), []
        for process, tasks, _ in workers:
            if process.is_alive():
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    pass
        for process, tasks, results in workers:
            process.join(timeout=1.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=1.0)
            for q in (tasks, results):
                q.cancel_join_thread()  # never block exit on a pipe no one will read
                q.close()

    def __repr__(self) -> str:
        return (f"ProcessLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"num_workers={self.num_workers}, start_method={self.start_method}, "
                f"worker_cpus={self.worker_cpus}, rank={self.rank}/{self.world_size})")


def _default_start_method() -> str:
    methods = mp.get_all_start_methods()
    if "fork" in methods and not torch.cuda.is_initialized():
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"
