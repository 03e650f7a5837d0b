"""``kasoku data bench``: can this loader keep up with this model on this machine (seed 000)?

Each loader of the list runs alone (no model) on each source and batch size: a fresh loader
per measurement (``kasoku.data.registry.create_loader``, so every loader kind ``--loader``
knows is measured the same way), its time to the first batch (construction and worker
start-up) and ``warmup`` further batches timed apart, then ``windows`` windows of ``batches``
batches. With a model, its training rate on synthetic batches already on the device is
measured once per batch size, and after each loader's own windows the same loader feeds the
same model (batches copied to the device), in windows timed the same way. Window ends synchronize the device, so batches a loader leaves on
a GPU are finished inside the window. The loader is closed after each measurement, on every
path; a loader that fails is recorded with its error and the sweep goes on.

One JSON line per measurement in ``OUT/data_bench.jsonl`` (appended; schema
``kasoku.data_bench/1``)::

    schema, run_id, time (UTC ISO-8601), source (the folder or workload given), source_label,
    source_kind ("folder" | "generated" | "workload"), resolution ("WxH" of a make-jpeg folder,
    else null), loader (e.g. "multiprocess:4"), batch_size, unit (what a sample is: "images",
    or "samples" for a workload whose samples are not images), device, status ("ok" | "error"),
    error (the error's last line, or null)
    settings: warmup_batches, batches_per_window, windows, seed, image_size, num_samples
    model:    null, or workload, config (the rung's config), notes (levers skipped here)
    figures:  images_per_s {median, min, max, n}: the loader alone, one value per window (the
                name is kept for every unit: samples per second)
              mb_per_s: images_per_s median x bytes_per_image / 1e6
              bytes_per_image: mean bytes of the samples delivered in the windows
              bytes_basis: "file" (the JPEG files' sizes: file bytes delivered, which the page
                cache may serve, what seed 000 called read bandwidth) | "stored sample" (the
                uint8 bytes of an in-memory sample) | "delivered sample" (the tensor's bytes)
              cpu_cores: CPU seconds of this process and the loader's worker processes per
                second of the windows ("cores busy"), at most the cores this process may use
                (the processes' times are read in clock ticks, so a reading can overshoot);
                cpu_percent: the same as % of those cores
              first_batch_s, warmup_s: construction + first batch, then the warm-up batches
              model_synthetic_images_per_s {median, min, max, n}: the model on synthetic
                on-device batches (the same in every line of a run)
              fed_images_per_s {median, min, max, n}: the model fed by this loader
              margin: loader alone / model synthetic (>= 1: the loader keeps up)
              fed_fraction: fed / model synthetic medians
    env:      as ``kasoku.perf.sysinfo.environment``

Figures a measurement did not reach are absent.
"""
from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kasoku.accel.config import AccelConfig
from kasoku.bench.data_report import (CHART_FILE, RESULTS_FILE, plot_data_bench, print_data_bench,
                                      progress_line)
from kasoku.bench.results import append_result
from kasoku.bench.data_sources import Source, in_memory, resolve_sources
from kasoku.config import DataConfig
from kasoku.data.registry import create_loader, parse_loader_spec
from kasoku.errors import ConfigError
from kasoku.train.run_dir import make_out_dir

SCHEMA = "kasoku.data_bench/1"
DEFAULT_BATCH_SIZE = 64
DEFAULT_IMAGE_SIZE = 224


@dataclass(frozen=True)
class DataBenchRequest:
    sources: tuple[str, ...] = ()
    """Image folders or workload names; with ``resolutions``, at most one folder that holds the
    generated folders (default ``out/jpeg``)."""
    loaders: tuple[str, ...] = ("serial",)
    """Loader specs as ``--loader`` takes them (``expand_loaders`` makes them from a list)."""
    resolutions: tuple[tuple[int, int], ...] = ()
    """Make (or reuse) a synthetic JPEG folder of each (width, height) and measure those."""
    images: int = 2048
    """Images per generated folder."""
    out: Path = Path("runs/data-bench")
    batch_sizes: tuple[int, ...] = ()
    """Batch sizes to measure each loader at (empty: the model's recipe batch size, else
    ``DEFAULT_BATCH_SIZE``)."""
    device: str = "cpu"
    warmup: int = 3
    """Batches after the first one, excluded from the windows."""
    batches: int = 10
    """Batches (and model steps) per timed window."""
    windows: int = 3
    seed: int = 0
    image_size: int | None = None
    """Crop size of image folders (None: the model's input size, else 224)."""
    data: DataConfig = field(default_factory=DataConfig)
    """How workload sources build their data (``--data``, ``--synthetic``)."""
    model: str | None = None
    """A workload whose training rate the loaders are compared with."""
    accel: AccelConfig | None = None
    """The model's levers (None: ``AccelConfig()``, what ``kasoku train`` uses)."""
    prefetch: int | None = None
    """Batches in flight for the loaders that make them ahead (``--prefetch``; None: each
    loader's default); serial and device loaders are measured as they are."""


@dataclass
class DataBenchResult:
    records: list[dict]
    chart: Path | None = None

    @property
    def exit_code(self) -> int:
        """0, or 1 when a loader failed."""
        return 1 if any(r["status"] != "ok" for r in self.records) else 0


def expand_loaders(text: str) -> list[str]:
    """``"serial,multiprocess:1,2,4"`` -> ``["serial", "multiprocess:1", "multiprocess:2",
    "multiprocess:4"]``: a bare number continues the kind before it. Each spec is checked as
    ``--loader`` checks it (``ConfigError``)."""
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            if not specs:
                raise ConfigError(f"--loader {text}: {item} continues no loader kind; write "
                                  f"the kind first, e.g. multiprocess:1,2,4")
            item = f"{specs[-1].partition(':')[0]}:{item}"
        parse_loader_spec(item)
        specs.append(item)
    if not specs:
        raise ConfigError("--loader names no loader; e.g. serial,multiprocess:1,2,4")
    return specs


class _Model:
    """A workload's model and training step (``kasoku.bench.worker``'s runner), measured on
    synthetic on-device batches and fed by loaders."""

    def __init__(self, name: str, accel: AccelConfig | None, device: torch.device, seed: int):
        from kasoku.bench.pool import batch_spec
        from kasoku.bench.rungs import Rung
        from kasoku.bench.worker import make_runner
        from kasoku.workloads import create_workload
        self.name, self.device, self.notes = name, device, []
        self.workload = create_workload(name)
        torch.manual_seed(seed)
        model = self.workload.build_model()
        self.spec = batch_spec(self.workload, model)
        self.rung = Rung("model", accel or AccelConfig())
        self.runner = make_runner(self.rung, self.workload, model.to(device), device,
                                   self.workload.recipe.lr, self.notes)

    def check(self, source: Source) -> None:
        shape = tuple(torch.as_tensor(source.dataset[0][0]).shape)
        if shape != self.spec.input_shape:
            raise ConfigError(f"{source.label} gives samples of shape {shape} but --model "
                              f"{self.name} takes {self.spec.input_shape}; give a source of "
                              f"that shape (e.g. the workload {self.name} itself, or an image "
                              f"folder cropped to its size)")

    def synthetic_rates(self, batch_size: int, req: DataBenchRequest, seed: int) -> dict:
        from kasoku.bench.pool import cycle, make_pool
        from kasoku.bench.timing import measure_windows, timed
        pool = make_pool(self.spec, batch_size, self.device, seed=seed)
        # The first step holds compilation and autotuning: warm-up, never in a window.
        timed(self.device, lambda: self.runner(cycle(pool, req.warmup + 1)))
        m, _ = measure_windows(self.runner, pool, self.device, batch_size, req.batches,
                               req.windows)
        return m.figures()["samples_per_s"]

    def fed_rates(self, loader, req: DataBenchRequest) -> dict:
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


def run_data_bench(req: DataBenchRequest, stream=None, progress=None) -> DataBenchResult:
    """Measure every (source, loader), print a progress line per measurement to ``progress``
    (stderr) and the table to ``stream`` (stdout), append the records to
    ``out/data_bench.jsonl`` and draw ``out/data_bench.png``."""
    from kasoku.device import resolve_device
    from kasoku.perf.sysinfo import environment
    stream, progress = stream or sys.stdout, progress or sys.stderr
    say = lambda *a: print(*a, file=progress, flush=True)  # noqa: E731
    _check(req)
    device = resolve_device(req.device)
    model = _Model(req.model, req.accel, device, req.seed) if req.model else None
    batch_sizes = req.batch_sizes or (model.workload.recipe.batch_size if model
                                      else DEFAULT_BATCH_SIZE,)
    image_size = req.image_size or _model_image_size(model) or DEFAULT_IMAGE_SIZE
    sources = resolve_sources(req, image_size, say)
    for source in sources:
        if len(source.dataset) < max(batch_sizes):
            raise ConfigError(f"{source.label} has {len(source.dataset)} samples, less than "
                              f"one batch of {max(batch_sizes)}: lower --batch-size (or raise "
                              f"--images / --synthetic-size)")
    for source in sources if model is not None else ():
        model.check(source)
    make_out_dir(req.out, "data_bench.jsonl and data_bench.png")  # before measuring anything
    model_rates = {}
    if model is not None:
        for bs in batch_sizes:
            say(f"model {model.name} bs {bs} on synthetic on-device batches ...")
            model_rates[bs] = rates = model.synthetic_rates(bs, req, req.seed)
            say(f"  {rates['median']:,.0f} {model.workload.sample_unit}/s (min "
                f"{rates['min']:,.0f}, max {rates['max']:,.0f})")
    env = environment(device)
    run_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    records, total = [], len(sources) * len(req.loaders) * len(batch_sizes)
    for batch_size, source, spec in ((b, s, spec) for b in batch_sizes for s in sources
                                     for spec in req.loaders):
        record = _record(req, source, spec, batch_size, device, model, run_id, env)
        try:
            spec_req = _scaled_to_workers(req, spec)
            record["settings"].update(warmup_batches=spec_req.warmup,
                                      batches_per_window=spec_req.batches)
            _measure(record["figures"], source, spec, batch_size, device, spec_req, model)
            if model is not None:
                _compare(record["figures"], model_rates[batch_size])
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
            record["error"] = _last_line(exc)
        append_result(req.out, record, RESULTS_FILE)
        records.append(record)
        say(f"[{len(records)}/{total}] {source.label} {spec} bs {batch_size}: "
            f"{progress_line(record)}")
    print_data_bench(records, file=stream)
    chart = plot_data_bench(records, Path(req.out) / CHART_FILE)
    print(f"results: {Path(req.out) / RESULTS_FILE}  chart: {chart}", file=stream)
    return DataBenchResult(records, chart)


def _check(req: DataBenchRequest) -> None:
    for name, value, least in (("--warmup", req.warmup, 0), ("--batches", req.batches, 1),
                               ("--windows", req.windows, 1), ("--images", req.images, 1),
                               ("--image-size", req.image_size, 8)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in req.batch_sizes):
        raise ConfigError(f"--batch-size must be whole numbers >= 1, got {req.batch_sizes}")
    if not req.loaders:
        raise ConfigError("--loader names no loader; e.g. serial,multiprocess:1,2,4")
    if req.accel is not None and req.accel.steps_per_call != 1:
        raise ConfigError("data bench feeds the model one batch per step; drop "
                          "--steps-per-call")


def _model_image_size(model: _Model | None) -> int | None:
    shape = model.spec.input_shape if model else ()
    return shape[1] if len(shape) == 3 and shape[0] == 3 and shape[1] == shape[2] else None


def _record(req, source, spec, batch_size, device, model, run_id, env) -> dict:
    return {
        "schema": SCHEMA, "run_id": run_id,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source.name, "source_label": source.label, "source_kind": source.kind,
        "resolution": source.resolution, "loader": spec, "batch_size": batch_size,
        "unit": source.unit,
        "device": device.type, "status": "error", "error": None,
        "settings": {"warmup_batches": req.warmup, "batches_per_window": req.batches,
                     "windows": req.windows, "seed": req.seed,
                     "image_size": getattr(source.dataset, "image_size", None),
                     "num_samples": len(source.dataset)},
        "model": None if model is None else {"workload": model.name,
                                             "config": model.rung.config_dict(),
                                             "notes": model.notes},
        "figures": {"bytes_basis": source.bytes_basis}, "env": env,
    }


def _scaled_to_workers(req: DataBenchRequest, spec: str) -> DataBenchRequest:
    """``req`` with the warm-up and the windows long enough for ``spec``'s workers: N
    processes finish their batches nearly together, so a window of fewer than ~4N batches
    reads a burst or a gap, not the steady rate (16 workers and 8-batch windows measured
    1,281 to 12,576 images/s for one loader); the warm-up (2N) lets the first burst pass."""
    kind, count = parse_loader_spec(spec)
    name = kind.name
    if name not in ("multiprocess", "gpu-jpeg-procs"):
        return req
    from kasoku.data.gpu_jpeg_procs import GpuJpegProcessLoader
    from kasoku.data.parallel_loader import ProcessLoader
    workers = count or (ProcessLoader if name == "multiprocess"
                        else GpuJpegProcessLoader).default_workers()
    return replace(req, warmup=max(req.warmup, 2 * workers),
                               batches=max(req.batches, 4 * workers))


def _measure(figures: dict, source: Source, spec: str, batch_size: int,
             device: torch.device, req: DataBenchRequest, model: _Model | None) -> None:
    from kasoku.perf.cpu import busy_cores, cpu_seconds, usable_cores
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
        figures["prefetch_batches"] = getattr(loader, "prefetch_batches", None)
        _take(loader, 1)
        _sync(device)
        figures["first_batch_s"] = time.perf_counter() - t0
        figures["warmup_s"] = _wall(device, lambda: _take(loader, req.warmup))[1]
        start = (getattr(loader, "epoch", None), getattr(loader, "position", None))
        pids = [os.getpid(), *_worker_pids(loader)]
        cpu_before, t0 = cpu_seconds(pids), time.perf_counter()
        spans = [_wall(device, lambda: _take(loader, req.batches)) for _ in range(req.windows)]
        wall_s = time.perf_counter() - t0
        cores = min(busy_cores(cpu_before, cpu_seconds(pids), wall_s), usable_cores())
        images = [n for n, _ in spans]
        figures["images_per_s"] = _rates(images, [s for _, s in spans])
        per_image = _delivered_bytes(loader, start, req.windows * req.batches,
                                     source.sample_bytes) / sum(images)
        figures.update(mb_per_s=figures["images_per_s"]["median"] * per_image / 1e6,
                       bytes_per_image=per_image, cpu_cores=cores,
                       cpu_percent=100 * cores / usable_cores())
        if model is not None:
            # Fed as `kasoku train` feeds it: host batches copied ahead on a side stream.
            from kasoku.data.prefetch import wrap_for_device
            figures["fed_images_per_s"] = model.fed_rates(wrap_for_device(loader, device), req)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def _compare(figures: dict, model_rates: dict) -> None:
    synthetic = model_rates["median"]
    figures["model_synthetic_images_per_s"] = model_rates
    figures["margin"] = figures["images_per_s"]["median"] / synthetic
    figures["fed_fraction"] = figures["fed_images_per_s"]["median"] / synthetic


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


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[-1] if text else type(exc).__name__
