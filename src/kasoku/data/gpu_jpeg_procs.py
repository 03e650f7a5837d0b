"""``GpuJpegProcessLoader``: gpu-jpeg's batches made in worker processes, handed over on the GPU.

In one process, each batch's decoder call and the Python around it (reading threads, crop
draws, the per-image table: ~6 ms per 256 images) take turns on one GIL, with each other and
with the training thread: the threaded ``GpuJpegLoader`` reached 13,500 images/s where one
decode call alone runs at 21,000, and a model it fed stalled behind it (research/notebook.md).
Here each of P worker processes (``ProcessLoader``'s: batch ``p`` of an epoch to worker
``p % P``, results in order, a dead worker named) reads, decodes and crops whole batches on
the GPU in a CUDA context of its own -- the work of ``JpegBatchMaker``, as the threaded loader
does it -- and sends the finished batch to the training process through CUDA IPC (PyTorch's
multiprocessing pickling of CUDA tensors): the memory is mapped, not copied, and the training
stream waits on the worker's event, never on the host. A worker frees a batch's memory once
the training process has dropped it (``torch.cuda.ipc_collect`` before each batch), so a batch
stays valid until the loader is closed, not after.

The order, sharding, ``(epoch, position)`` resume state, crops, flips and bad-file handling
are ``GpuJpegLoader``'s, so both (and the serial loader) yield the same samples. Without CUDA
the workers decode with Pillow and crop on the CPU, and batches come back through shared
memory; that is what the CPU tests run.
"""
from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from kasoku.data.gpu_jpeg import JpegBatchMaker
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.jpeg_decoders import DECODER_ENV, DECODERS
from kasoku.data.parallel_loader import ProcessLoader


class _JpegBatches:
    """What a worker process sees as its dataset: ``start_batch(indices)`` has
    ``num_threads`` threads read the files, ``finish_batch`` decodes and crops them on
    ``device`` (``get_batch`` does both). Picklable: the decoder, the threads and the CUDA
    context are created in the worker, at its first batch."""

    def __init__(self, folder: ImageFolder, device: torch.device, decoder: str,
                 num_threads: int):
        self.folder, self.device, self.decoder = folder, device, decoder
        self.num_threads, self.epoch = num_threads, 0
        self._maker = self._pool = None
        self._held: collections.deque = collections.deque()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maker": None, "_pool": None, "_held": collections.deque()}

    def __len__(self) -> int:
        return len(self.folder)

    samples = property(lambda self: self.folder.samples)
    bad_files = property(lambda self: self.folder.bad_files)
    strict = property(lambda self: self.folder.strict)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.folder.set_epoch(epoch)

    def start_batch(self, indices: list[int]):
        """Start reading the files of a batch (the worker loop calls this for the next batch
        before it finishes the current one, so reading overlaps decoding)."""
        if self._maker is None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._maker = JpegBatchMaker(self.folder, self.device, self.decoder,
                                         own_process=True)
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="kasoku-jpeg-read")
        step = -(-len(indices) // self.num_threads)
        return list(indices), [self._pool.submit(self._maker.read_many, indices[k:k + step])
                               for k in range(0, len(indices), step)]

    def finish_batch(self, handle):
        """Decode and crop a started batch: ``(x on the device, y in host memory)``."""
        idx, reads = handle
        prepared = [item for f in reads for item in f.result()]
        if self.device.type != "cuda":
            x, y, _ = self._maker.assemble(self.epoch, idx, prepared, host_labels=True)
            return x, y
        torch.cuda.ipc_collect()  # free the batches the training process has let go of
        x, y, buffers = self._maker.assemble(self.epoch, idx, prepared, host_labels=True)
        if buffers is not None:  # the decoder's own memory: alive until the stream has read it
            event = torch.cuda.Event()
            event.record()
            self._held.append((event, buffers))
            while self._held and self._held[0][0].query():
                self._held.popleft()
        return x, y

    def get_batch(self, indices: torch.Tensor):
        return self.finish_batch(self.start_batch(indices.tolist()))


class GpuJpegProcessLoader(ProcessLoader):
    """``SerialLoader`` over an ``ImageFolder`` whose batches are read, decoded and cropped on
    ``device`` by ``num_workers`` worker processes (``default_workers``), each reading with
    ``num_threads`` threads. ``decoder`` (or ``KASOKU_GPU_JPEG_DECODER``): as
    ``GpuJpegLoader``'s, except that ``auto`` tries nvImageCodec first. Batches are
    ``(float32 [B, 3, S, S], int64 [B])`` on ``device``,
    valid until ``close()``. Takes ``SerialLoader``'s keyword arguments and
    ``prefetch_batches`` (per worker)."""

    yields_device_batches = True

    def __init__(self, dataset: ImageFolder, batch_size: int, device="cuda",
                 num_workers: int | None = None, num_threads: int | None = None,
                 decoder: str = "auto", prefetch_batches: int = 2, **kwargs):
        if not isinstance(dataset, ImageFolder):
            raise TypeError(f"the gpu-jpeg-procs loader reads JPEG folders (ImageFolder); "
                            f"{dataset!r} is not one: use the device, serial, threads or "
                            f"multiprocess loader")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        choice = os.environ.get(DECODER_ENV, "") or decoder
        if choice not in DECODERS:
            raise ValueError(f"unknown JPEG decoder {choice!r} ({DECODER_ENV}); use one of "
                             f"{', '.join(DECODERS)}")
        workers = num_workers or self.default_workers()
        threads = num_threads or max(2, min(8, (os.cpu_count() or 1) // max(1, workers)))
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self.num_threads = threads
        start = kwargs.pop("start_method", None)
        if start is None and self.device.type == "cuda":
            # A worker opens a CUDA context of its own: never a fork of a process that has one.
            import multiprocessing as mp
            start = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        super().__init__(_JpegBatches(dataset, self.device, choice, threads), batch_size,
                         num_workers=workers, prefetch_batches=prefetch_batches,
                         pin_memory=False, start_method=start, **kwargs)

    @staticmethod
    def default_workers() -> int:
        """8 (alone on an H200 host of 16 cores, with the crop kernel: 4 / 6 / 8 decoding
        processes gave 21,254 / 22,355 / 28,884 images/s), or half the cores where there
        are fewer than 16."""
        return max(1, min(8, (os.cpu_count() or 1) // 2))

    def _collect(self, position, indices, tag):
        x, y = super()._collect(position, indices, tag)
        # Labels travel in host memory (one CUDA IPC mapping per batch, not two).
        return x, y.to(x.device, non_blocking=True)

    def __repr__(self) -> str:
        return (f"GpuJpegProcessLoader({self.dataset.folder!r}, batch_size={self.batch_size}, "
                f"workers={self.num_workers}, threads={self.num_threads}, "
                f"decoder={self.dataset.decoder}, device={self.device}, "
                f"rank={self.rank}/{self.world_size})")
