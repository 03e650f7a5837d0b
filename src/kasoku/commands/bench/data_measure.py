"""One ``kasoku data bench`` measurement: a loader alone -- its first batch, warm-up, timed
windows, MB/s of what it delivered, cores busy -- and a model on synthetic on-device batches and
fed by that loader. Window ends synchronize the device, so batches a loader leaves on a GPU are
finished inside the window; the host work of a loader is part of what is timed, so device events
alone would not do."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kasoku.accel.config import AccelConfig
from kasoku.accel.teardown import release_levers
from kasoku.commands.bench.data_sources import Source, in_memory
from kasoku.commands.bench.pool import batch_spec, cycle, make_pool
from kasoku.commands.bench.rungs import Rung
from kasoku.commands.bench.runner import make_runner
from kasoku.commands.bench.timing import EXTRA_BUDGET_S, EXTRA_WINDOWS, measure_windows, timed
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.bad_files import BAD_FILES, BadFileWriter
from kasoku.data.gpu_jpeg_procs import GpuJpegProcessLoader
from kasoku.data.parallel_loader import ProcessLoader
from kasoku.data.prefetch import wrap_for_device
from kasoku.data.registry import create_loader, parse_loader_spec
from kasoku.perf import cpu
from kasoku.perf.noise import MachineWatch, Stability, spread
from kasoku.workloads import create_workload


class LoaderModel:
    """A workload's model and training step (``kasoku.commands.bench.worker``'s runner), measured on
    synthetic on-device batches and fed by loaders. ``req``: the ``DataBenchRequest`` (its
    ``warmup``, ``batches`` and ``windows``).

    One build per batch size (``at``), as ``kasoku bench`` has one process per batch size: a
    CUDA graph holds one batch shape (a later batch size would run outside it, eagerly) and
    the step is compiled for its own shapes; the previous build is released first."""

    def __init__(self, name: str, accel: AccelConfig | None, device: torch.device, seed: int):
        self.name, self.device, self.notes, self.seed = name, device, [], seed
        self.workload = create_workload(name)
        self.rung = Rung("model", accel or AccelConfig())
        self._first = self._model()  # read for the shapes, then trained by the first build
        self.spec = batch_spec(self.workload, self._first)
        self.runner, self.batch_size = None, None

    def _model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return self.workload.build_model()

    def at(self, batch_size: int) -> None:
        """Build the step that ``synthetic_rates`` and ``fed_rates`` run at ``batch_size``."""
        if batch_size == self.batch_size:
            return
        if self.runner is not None:
            release_levers(getattr(self.runner, "step", None), self.device)
            self.runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.notes = []  # the levers' notes of this build (each build notes the same)
        model = self._first if self._first is not None else self._model()
        self._first = None
        self.runner = make_runner(self.rung, self.workload, model.to(self.device), self.device,
                                  self.workload.recipe.lr, self.notes)
        self.batch_size = batch_size

    def check(self, source: Source) -> None:
        shape = tuple(torch.as_tensor(source.dataset[0][0]).shape)
        if shape != self.spec.input_shape:
            raise ConfigError(f"{source.label} gives samples of shape {shape} but "
                              f"{flag('data_bench.model')} {self.name} takes "
                              f"{self.spec.input_shape}; give a source of that shape (e.g. the "
                              f"workload {self.name} itself, or an image folder cropped to its "
                              "size)")

    def synthetic_rates(self, batch_size: int, req, seed: int) -> dict:
        self.at(batch_size)
        pool = make_pool(self.spec, batch_size, self.device, seed=seed)
        # The first step holds compilation and autotuning: warm-up, never in a window.
        timed(self.device, lambda: self.runner(cycle(pool, req.warmup + 1)))
        m, _ = measure_windows(self.runner, pool, self.device, batch_size, req.batches,
                               req.windows)
        return m.figures()["samples_per_s"]

    def fed_rates(self, loader, req) -> dict:
        counts = []

        def feed(n: int):
            for _ in range(n):
                x, y = next(loader)[:2]
                counts[-1] += len(x)
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

        counts.append(0)
        _wall(self.device, lambda: self.runner(feed(req.warmup + 1)))
        seconds = []
        for _ in range(req.windows):
            counts.append(0)
            seconds.append(_wall(self.device, lambda: self.runner(feed(req.batches)))[1])
        return _rates(counts[1:], seconds)


def scaled_to_workers(req, spec: str):
    """``req`` with the warm-up and the windows long enough for ``spec``'s workers: N
    processes finish their batches nearly together, so a window of fewer than ~4N batches
    reads a burst or a gap, not the steady rate (16 workers and 8-batch windows measured
    1,281 to 12,576 images/s for one loader); the warm-up (2N) lets the first burst pass."""
    kind, count = parse_loader_spec(spec)
    name = kind.name
    if name not in ("multiprocess", "gpu-jpeg-procs"):
        return req
    workers = count or (ProcessLoader if name == "multiprocess"
                        else GpuJpegProcessLoader).default_workers()
    return replace(req, warmup=max(req.warmup, 2 * workers), batches=max(req.batches, 4 * workers))


def measure_loader(figures: dict, source: Source, spec: str, batch_size: int,
                   device: torch.device, req, model: LoaderModel | None) -> None:
    """Measure loader ``spec`` alone on ``source`` (and feeding ``model``, if any) with the
    settings of ``req`` (a ``DataBenchRequest``), into ``figures`` (the keys:
    ``kasoku.commands.bench.data_bench``); the loader is closed on every path."""
    kind = parse_loader_spec(spec)[0]
    dataset = in_memory(source.dataset) if kind.name == "device" else source.dataset
    prefetch = req.prefetch if kind.prefetching else None
    t0 = time.perf_counter()
    loader = None
    try:
        # Full batches only: every window counts the same work, and a compiled or graphed
        # model never meets a second shape.
        loader = create_loader(spec, dataset, batch_size, device, seed=req.seed,
                               drop_last=True, prefetch=prefetch)
        bad_files = BadFileWriter(Path(req.out) / BAD_FILES).watch(loader)
        figures["prefetch_batches"] = getattr(loader, "prefetch_batches", None)
        _take(loader, 1)
        _sync(device)
        figures["first_batch_s"] = time.perf_counter() - t0
        figures["warmup_s"] = _wall(device, lambda: _take(loader, req.warmup))[1]
        start = (getattr(loader, "epoch", None), getattr(loader, "position", None))
        pids = [os.getpid(), *_worker_pids(loader)]
        watch = MachineWatch(own=pids, device=device).start()
        cpu_before, t0 = cpu.cpu_seconds(pids), time.perf_counter()
        spans = [_wall(device, lambda: _take(loader, req.batches)) for _ in range(req.windows)]
        # More windows while they disagree: up to twice as many again, within their time.
        budget = min(EXTRA_BUDGET_S, 2 * sum(sec for _, sec in spans))
        while (not spread([n / sec for n, sec in spans]).stable
               and len(spans) < (1 + EXTRA_WINDOWS) * req.windows and budget > 0):
            spans.append(_wall(device, lambda: _take(loader, req.batches)))
            budget -= spans[-1][1]
        wall_s = time.perf_counter() - t0
        cores = min(cpu.busy_cores(cpu_before, cpu.cpu_seconds(pids), wall_s), cpu.usable_cores())
        images = [n for n, _ in spans]
        figures["images_per_s"] = _rates(images, [s for _, s in spans])
        figures["stability"] = Stability(spread([n / s for n, s in spans]), watch.stop(),
                                         len(spans) - req.windows).to_dict()
        per_image = _delivered_bytes(loader, start, len(spans) * req.batches,
                                     source.sample_bytes) / sum(images)
        figures.update(mb_per_s=figures["images_per_s"]["median"] * per_image / 1e6,
                       bytes_per_image=per_image, cpu_cores=cores,
                       cpu_percent=100 * cores / cpu.usable_cores())
        if model is not None:
            # Fed as `kasoku train` feeds it: host batches copied ahead on a side stream.
            model.at(batch_size)
            figures["fed_images_per_s"] = model.fed_rates(wrap_for_device(loader, device), req)
    finally:
        if loader is not None:
            figures["skipped_files"] = bad_files.write_skipped(loader, source=source.label,
                                                               loader=spec)
        if loader is not None:
            loader.close()


def _take(loader, n: int) -> int:
    """Take ``n`` batches; returns the samples they held (a shape read: no device sync)."""
    return sum(len(next(loader)[0]) for _ in range(n))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a host sync, at window ends only


def _wall(device: torch.device, fn):
    """``(fn(), seconds)`` of wall time, the device's work finished at both ends: the host
    work of a loader is part of what is timed, so device events alone would not do."""
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def _rates(counts: list[int], seconds: list[float]) -> dict:
    rates = [n / s for n, s in zip(counts, seconds)]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "n": len(rates)}


def _worker_pids(loader) -> list[int]:
    workers = getattr(loader, "_workers", ())
    return [w[0].pid for w in workers if getattr(w[0], "pid", None) is not None]


def _delivered_bytes(loader, start, num_batches: int, sample_bytes) -> float:
    """Bytes of the samples of ``num_batches`` batches taken from loader state ``start``
    (epoch, position): exact for loaders with ``SerialLoader``'s order, else the mean."""
    if np.ndim(sample_bytes) == 0:
        return float(sample_bytes) * num_batches * loader.batch_size
    epoch, position = start
    if epoch is None or position is None or not hasattr(loader, "epoch_indices"):
        return float(np.mean(sample_bytes)) * num_batches * loader.batch_size
    total, order, size = 0, None, loader.batch_size
    for _ in range(num_batches):
        if order is None:
            order = loader.epoch_indices(epoch).cpu().numpy()
        total += int(sample_bytes[order[position * size:(position + 1) * size]].sum())
        position += 1
        if position == loader.batches_per_epoch:
            epoch, position, order = epoch + 1, 0, None
    return float(total)
