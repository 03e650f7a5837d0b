"""``kasoku data bench``: can this loader keep up with this model on this machine (seed 000)?

Each loader of the list runs alone (no model) on each source and batch size: a fresh loader per
measurement (``kasoku.data.registry.create_loader``, so every loader kind ``--loader`` knows is
measured the same way), its time to the first batch (construction and worker start-up) and
``warmup`` further batches timed apart, then ``windows`` windows of ``batches`` batches. With a
model, its training rate on synthetic batches already on the device is measured once per batch size,
and after each loader's own windows the same loader feeds the same model (batches copied to the
device), in windows timed the same way (the measurement itself:
``kasoku.commands.bench.data_measure``). The loader is closed after each measurement, on every path;
a loader that fails is recorded with its error and the sweep goes on.

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
              skipped_files: the bad files the loader had skipped (those of the loaders before
                it on the same source too, where they read in this process), each listed with
                its reason in ``out/bad_files.jsonl``
    env:      as ``kasoku.perf.sysinfo.environment``

Figures a measurement did not reach are absent.
"""
from __future__ import annotations

import datetime as dt
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kasoku.accel.config import AccelConfig
from kasoku.commands.bench.data_measure import LoaderModel, measure_loader, scaled_to_workers
from kasoku.commands.bench.data_report import (
    CHART_FILE,
    RESULTS_FILE,
    plot_data_bench,
    print_data_bench,
    progress_line,
)
from kasoku.commands.bench.data_sources import resolve_sources, sample_word
from kasoku.commands.bench.results import append_result
from kasoku.commands.device import resolve_device
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.bad_files import BAD_FILES, BadFileWriter
from kasoku.data.config import DataConfig
from kasoku.data.registry import expand_loaders  # noqa: F401  (kasoku data bench --loader)
from kasoku.perf.sysinfo import environment
from kasoku.train.run_dir import make_out_dir
from kasoku.workloads.registry import default_batch_sizes

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


def run_data_bench(req: DataBenchRequest, stream=None, progress=None) -> DataBenchResult:
    """Measure every (source, loader), print a progress line per measurement to ``progress``
    (stderr) and the table to ``stream`` (stdout), append the records to
    ``out/data_bench.jsonl`` and draw ``out/data_bench.png``."""
    stream, progress = stream or sys.stdout, progress or sys.stderr
    say = lambda *a: print(*a, file=progress, flush=True)  # noqa: E731
    _check(req)
    device = resolve_device(req.device)
    model = LoaderModel(req.model, req.accel, device, req.seed) if req.model else None
    batch_sizes = req.batch_sizes or (
        default_batch_sizes(model.workload.recipe.batch_size, "data") if model
        else (DEFAULT_BATCH_SIZE,))
    image_size = req.image_size or _model_image_size(model) or DEFAULT_IMAGE_SIZE
    sources = resolve_sources(req, image_size, say)
    for source in sources:
        if len(source.dataset) < max(batch_sizes):
            raise ConfigError(f"{source.label} has {len(source.dataset)} samples, less than one "
                              f"batch of {max(batch_sizes)}: lower {flag('train.batch_size')} (or "
                              f"raise {flag('data_bench.images')} / "
                              f"{flag('data.synthetic_train_size')})")
    for source in sources if model is not None else ():
        model.check(source)
    make_out_dir(req.out, "data_bench.jsonl and data_bench.png")  # before measuring anything
    model_rates = {}
    env = environment(device)
    run_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    records, total = [], len(sources) * len(req.loaders) * len(batch_sizes)
    for batch_size, source, spec in ((b, s, spec) for b in batch_sizes for s in sources
                                     for spec in req.loaders):
        if model is not None and batch_size not in model_rates:
            # Each batch size's own build (LoaderModel.at), measured before its loaders.
            say(f"model {model.name} bs {batch_size} on synthetic on-device batches ...")
            model_rates[batch_size] = rates = model.synthetic_rates(batch_size, req, req.seed)
            say(f"  {rates['median']:,.0f} {sample_word(model.workload)}/s (min "
                f"{rates['min']:,.0f}, max {rates['max']:,.0f})")
        record = _record(req, source, spec, batch_size, device, model, run_id, env)
        try:
            spec_req = scaled_to_workers(req, spec)
            record["settings"].update(warmup_batches=spec_req.warmup,
                                      batches_per_window=spec_req.batches)
            measure_loader(record["figures"], source, spec, batch_size, device, spec_req, model)
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
    print(f"results: {Path(req.out) / RESULTS_FILE}  chart: "
          f"{chart or 'none (no loader was measured)'}", file=stream)
    if any(r["figures"].get("skipped_files") for r in records):
        bad = BadFileWriter(Path(req.out) / BAD_FILES)
        print(f"bad files: {bad.count()}, each listed with its reason in {bad.path}", file=stream)
    return DataBenchResult(records, chart)


def _check(req: DataBenchRequest) -> None:
    for name, value, least in ((flag("data_bench.warmup"), req.warmup, 0),
                               (flag("data_bench.batches"), req.batches, 1),
                               (flag("data_bench.windows"), req.windows, 1),
                               (flag("data_bench.images"), req.images, 1),
                               (flag("data_bench.image_size"), req.image_size, 8)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in req.batch_sizes):
        raise ConfigError(f"{flag('train.batch_size')} must be whole numbers >= 1, got "
                          f"{req.batch_sizes}")
    if not req.loaders:
        raise ConfigError(f"{flag('train.loader')} names no loader; e.g. serial,multiprocess:1,2,4")
    if req.accel is not None and req.accel.steps_per_call != 1:
        raise ConfigError("data bench feeds the model one batch per step; drop "
                          f"{flag('accel.steps_per_call')}")


def _model_image_size(model: LoaderModel | None) -> int | None:
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


def _compare(figures: dict, model_rates: dict) -> None:
    synthetic = model_rates["median"]
    figures["model_synthetic_images_per_s"] = model_rates
    figures["margin"] = figures["images_per_s"]["median"] / synthetic
    figures["fed_fraction"] = figures["fed_images_per_s"]["median"] / synthetic


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[-1] if text else type(exc).__name__
