"""``kasoku data bench``: can this loader keep up with this model on this machine (seed 000)?

Each loader of the list runs alone (no model) on each source: a fresh loader per measurement
(``kasoku.run._make_loader``, so every loader kind ``--loader`` knows is measured the same
way), its time to the first batch (construction and worker start-up) and ``warmup`` further
batches timed apart, then ``windows`` windows of ``batches`` batches. With a model, its
training rate on synthetic batches already on the device is measured once, and after each
loader's own windows the same loader feeds the same model (batches copied to the device), in
windows timed the same way. Window ends synchronize the device, so batches a loader leaves on
a GPU are finished inside the window. The loader is closed after each measurement, on every
path; a loader that fails is recorded with its error and the sweep goes on.

One JSON line per measurement in ``OUT/data_bench.jsonl`` (appended; schema
``kasoku.data_bench/1``)::

    schema, run_id, time (UTC ISO-8601), source (the folder or workload given), source_label,
    source_kind ("folder" | "generated" | "workload"), resolution ("WxH" of a make-jpeg folder,
    else null), loader (e.g. "multiprocess:4"), batch_size, device, status ("ok" | "error"),
    error (the error's last line, or null)
    settings: warmup_batches, batches_per_window, windows, seed, image_size, num_samples
    model:    null, or workload, config (the rung's config), notes (levers skipped here)
    figures:  images_per_s {median, min, max, n}: the loader alone, one value per window
              mb_per_s: images_per_s median x bytes_per_image / 1e6
              bytes_per_image: mean bytes of the samples delivered in the windows
              bytes_basis: "file" (the JPEG files' sizes: file bytes delivered, which the page
                cache may serve, what seed 000 called read bandwidth) | "stored sample" (the
                uint8 bytes of an in-memory sample) | "delivered sample" (the tensor's bytes)
              cpu_cores: CPU seconds of this process and the loader's worker processes per
                second of the windows ("cores busy"); cpu_percent: the same as % of all cores
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
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kasoku.accel.config import AccelConfig
from kasoku.config import DataConfig
from kasoku.errors import ConfigError

SCHEMA = "kasoku.data_bench/1"
RESULTS_FILE = "data_bench.jsonl"
CHART_FILE = "data_bench.png"
DEFAULT_BATCH_SIZE = 64
DEFAULT_IMAGE_SIZE = 224
GENERATED_CLASSES = 10


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
    batch_size: int | None = None
    """None: the model's recipe batch size, else ``DEFAULT_BATCH_SIZE``."""
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


@dataclass
class Source:
    name: str
    label: str
    kind: str
    resolution: str | None
    dataset: object
    sample_bytes: np.ndarray | int
    """Bytes per sample index (file sizes), or one size for every sample."""
    bytes_basis: str


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
    from kasoku.run import _parse_loader
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            if not specs:
                raise ConfigError(f"--loader {text}: {item} continues no loader kind; write "
                                  f"the kind first, e.g. multiprocess:1,2,4")
            item = f"{specs[-1].partition(':')[0]}:{item}"
        _parse_loader(item)
        specs.append(item)
    if not specs:
        raise ConfigError("--loader names no loader; e.g. serial,multiprocess:1,2,4")
    return specs


def prepare_jpeg_folders(holder: Path, resolutions, images: int, seed: int = 0,
                         say=print) -> list[Path]:
    """``holder/WxH`` for each resolution: a make-jpeg folder of at least ``images`` images,
    reused when one is there, made (with a progress line) otherwise."""
    from kasoku.data.jpeg_synth import make_jpeg_folder
    folders = []
    for w, h in resolutions:
        folder = Path(holder) / f"{w}x{h}"
        made = _make_jpeg_stats(folder)
        if made.get("complete") and made.get("num_images", 0) >= images \
                and (made.get("width"), made.get("height")) == (w, h):
            say(f"reusing {folder} ({made['num_images']} images)")
        else:
            say(f"making {images} JPEG images of {w}x{h} in {folder} ...")
            try:
                make_jpeg_folder(folder, images, w, h, num_classes=GENERATED_CLASSES,
                                 seed=seed)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        folders.append(folder)
    return folders


def _make_jpeg_stats(folder: Path) -> dict:
    from kasoku.data.jpeg_synth import MARKER
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def resolve_sources(req: DataBenchRequest, image_size: int, say=print) -> list[Source]:
    """The datasets to measure: generated folders, image folders or workloads' training sets."""
    from kasoku.workloads import list_workloads
    if req.resolutions:
        if len(req.sources) > 1:
            raise ConfigError("with --resolution give at most one SOURCE: the folder that "
                              "holds the generated JPEG folders (default OUT/jpeg)")
        holder = Path(req.sources[0]) if req.sources else Path(req.out) / "jpeg"
        if req.sources and not holder.is_dir() and req.sources[0] in list_workloads():
            raise ConfigError(f"with --resolution, SOURCE is the folder to hold the generated "
                              f"JPEG folders; {req.sources[0]} is a workload")
        folders = prepare_jpeg_folders(holder, req.resolutions, req.images, req.seed, say)
        return [_folder_source(f, image_size, req, "generated") for f in folders]
    if not req.sources:
        raise ConfigError("give a SOURCE (an image folder or a workload) or --resolution WxH "
                          "to measure generated JPEG folders")
    sources = []
    for name in req.sources:
        if Path(name).is_dir():
            sources.append(_folder_source(Path(name), image_size, req, "folder"))
        elif name in list_workloads():
            sources.append(_workload_source(name, req))
        else:
            raise ConfigError(f"SOURCE {name!r} is neither a folder nor a workload: give an "
                              f"ImageNet-style image folder (ROOT/<class>/*.jpg; `kasoku data "
                              f"make-jpeg` makes one) or one of {', '.join(list_workloads())}")
    return sources


def _folder_source(root: Path, image_size: int, req: DataBenchRequest, kind: str) -> Source:
    from kasoku.data.imagefolder import imagefolder_datasets
    train, _ = imagefolder_datasets(root, image_size=image_size, seed=req.seed,
                                    strict=req.data.strict)
    made = _make_jpeg_stats(train.root)
    resolution = f"{made['width']}x{made['height']}" if made.get("complete") else None
    label = resolution if kind == "generated" else \
        f"{root.name} ({resolution})" if resolution else root.name
    return Source(str(root), label, kind, resolution, train, *_sample_bytes(train))


def _workload_source(name: str, req: DataBenchRequest) -> Source:
    from kasoku.workloads import create_workload
    train, _ = create_workload(name).build_datasets(req.data, seed=req.seed)
    label = f"{name} ({'synthetic' if req.data.synthetic else 'data'})"
    return Source(name, label, "workload", None, train, *_sample_bytes(train))


def _sample_bytes(dataset) -> tuple[np.ndarray | int, str]:
    samples = getattr(dataset, "samples", None)
    if samples is not None:  # computed once per source: one stat per file
        return np.array([os.stat(path).st_size for path, _ in samples], np.int64), "file"
    inputs = getattr(dataset, "inputs", None)
    if isinstance(inputs, torch.Tensor):
        return inputs[0].numel() * inputs.element_size(), "stored sample"
    base = getattr(dataset, "base", None)  # a workload's synthetic split of stored bytes
    if base is not None and hasattr(base, "input_shape") and hasattr(base, "dtype"):
        return int(np.prod(base.input_shape)) * base.dtype.itemsize, "stored sample"
    x = torch.as_tensor(dataset[0][0])
    return x.numel() * x.element_size(), "delivered sample"


def _in_memory(dataset):
    """``dataset`` in the form ``DeviceLoader`` takes (``inputs``/``targets`` tensors): a
    workload's synthetic split is gathered once, keeping its uint8 images and leaving its
    transform to run per batch, as the real MNIST and CIFAR-10 sets do."""
    base = getattr(dataset, "base", None)
    if hasattr(dataset, "inputs") or base is None or not hasattr(dataset, "start"):
        return dataset
    from kasoku.data.base import ArrayDataset
    x, t = base.get_batch(torch.arange(dataset.start, dataset.start + len(dataset)))
    return ArrayDataset(x, t, transform=dataset.transform, name=dataset.name)


class _Model:
    """A workload's model and training step (``kasoku.bench.worker``'s runner), measured on
    synthetic on-device batches and fed by loaders."""

    def __init__(self, name: str, accel: AccelConfig | None, device: torch.device, seed: int):
        from kasoku.bench.pool import batch_spec
        from kasoku.bench.rungs import Rung
        from kasoku.bench.worker import _make_runner
        from kasoku.workloads import create_workload
        self.name, self.device, self.notes = name, device, []
        self.workload = create_workload(name)
        torch.manual_seed(seed)
        model = self.workload.build_model()
        self.spec = batch_spec(self.workload, model)
        self.rung = Rung("model", accel or AccelConfig())
        self.runner = _make_runner(self.rung, self.workload, model.to(device), device,
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
    from kasoku.perf.sysinfo import environment
    from kasoku.run import resolve_device
    stream, progress = stream or sys.stdout, progress or sys.stderr
    say = lambda *a: print(*a, file=progress, flush=True)  # noqa: E731
    _check(req)
    device = resolve_device(req.device)
    model = _Model(req.model, req.accel, device, req.seed) if req.model else None
    batch_size = req.batch_size or (model.workload.recipe.batch_size if model
                                    else DEFAULT_BATCH_SIZE)
    image_size = req.image_size or _model_image_size(model) or DEFAULT_IMAGE_SIZE
    sources = resolve_sources(req, image_size, say)
    for source in sources:
        if len(source.dataset) < batch_size:
            raise ConfigError(f"{source.label} has {len(source.dataset)} samples, less than "
                              f"one batch of {batch_size}: lower --batch-size (or raise "
                              f"--images / --synthetic-size)")
    model_rates = None
    if model is not None:
        for source in sources:
            model.check(source)
        say(f"model {model.name} bs {batch_size} on synthetic on-device batches ...")
        model_rates = model.synthetic_rates(batch_size, req, req.seed)
        say(f"  {model_rates['median']:,.0f} images/s (min {model_rates['min']:,.0f}, "
            f"max {model_rates['max']:,.0f})")
    env = environment(device)
    run_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    records, total = [], len(sources) * len(req.loaders)
    for source in sources:
        for spec in req.loaders:
            record = _record(req, source, spec, batch_size, device, model, run_id, env)
            try:
                spec_req = _scaled_to_workers(req, spec)
                record["settings"].update(warmup_batches=spec_req.warmup,
                                          batches_per_window=spec_req.batches)
                _measure(record["figures"], source, spec, batch_size, device, spec_req, model)
                if model_rates is not None:
                    _compare(record["figures"], model_rates)
                record["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                record["error"] = _last_line(exc)
            _append(req.out, record)
            records.append(record)
            say(f"[{len(records)}/{total}] {source.label} {spec}: {_progress(record)}")
    print_data_bench(records, file=stream)
    chart = plot_data_bench(records, Path(req.out) / CHART_FILE)
    print(f"results: {Path(req.out) / RESULTS_FILE}  chart: {chart}", file=stream)
    return DataBenchResult(records, chart)


def _check(req: DataBenchRequest) -> None:
    for name, value, least in (("--warmup", req.warmup, 0), ("--batches", req.batches, 1),
                               ("--windows", req.windows, 1), ("--images", req.images, 1),
                               ("--batch-size", req.batch_size, 1),
                               ("--image-size", req.image_size, 8)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
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
    from kasoku.run import _parse_loader
    name, count = _parse_loader(spec)
    if name != "multiprocess":
        return req
    from kasoku.data.parallel_loader import ProcessLoader
    workers = count or ProcessLoader.default_workers()
    return replace(req, warmup=max(req.warmup, 2 * workers),
                               batches=max(req.batches, 4 * workers))


def _measure(figures: dict, source: Source, spec: str, batch_size: int,
             device: torch.device, req: DataBenchRequest, model: _Model | None) -> None:
    from kasoku.perf.cpu import busy_cores, cpu_seconds
    from kasoku.run import _make_loader, _parse_loader
    dataset = _in_memory(source.dataset) if _parse_loader(spec)[0] == "device" \
        else source.dataset
    t0 = time.perf_counter()
    loader = None
    try:
        # Full batches only: every window counts the same work, and a compiled or graphed
        # model never meets a second shape.
        loader = _make_loader(spec, dataset, batch_size, device, seed=req.seed, drop_last=True)
        _take(loader, 1)
        _sync(device)
        figures["first_batch_s"] = time.perf_counter() - t0
        figures["warmup_s"] = _wall(device, lambda: _take(loader, req.warmup))[1]
        start = (getattr(loader, "epoch", None), getattr(loader, "position", None))
        pids = [os.getpid(), *_worker_pids(loader)]
        cpu_before, t0 = cpu_seconds(pids), time.perf_counter()
        spans = [_wall(device, lambda: _take(loader, req.batches)) for _ in range(req.windows)]
        wall_s = time.perf_counter() - t0
        cores = busy_cores(cpu_before, cpu_seconds(pids), wall_s)
        images = [n for n, _ in spans]
        figures["images_per_s"] = _rates(images, [s for _, s in spans])
        per_image = _delivered_bytes(loader, start, req.windows * req.batches,
                                     source.sample_bytes) / sum(images)
        figures.update(mb_per_s=figures["images_per_s"]["median"] * per_image / 1e6,
                       bytes_per_image=per_image, cpu_cores=cores,
                       cpu_percent=100 * cores / (os.cpu_count() or 1))
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


def _append(out: Path, record: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RESULTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _progress(record: dict) -> str:
    if record["status"] != "ok":
        return f"ERROR: {record['error']}"
    f = record["figures"]
    r = f["images_per_s"]
    text = (f"{r['median']:,.0f} images/s (min {r['min']:,.0f}, max {r['max']:,.0f}), "
            f"{f['mb_per_s']:,.1f} MB/s, {f['cpu_cores']:.2f} cores busy, first batch "
            f"{f['first_batch_s']:.2f} s")
    if "margin" in f:
        text += (f"; fed {f['fed_images_per_s']['median']:,.0f} images/s, "
                 f"{_verdict(f['margin'], record['device'])}")
    return text


def _verdict(margin: float, device_type: str) -> str:
    if margin >= 1:
        return f"x{margin:.1f}: keeps up"
    who = "the GPU" if device_type == "cuda" else "the model"
    return f"x{margin:.1f}: {who} waits {100 * (1 - margin):.0f}%"


def print_data_bench(records: list[dict], file=None) -> None:
    """One row per measurement: the loader alone, and against the model where there is one."""
    from kasoku.report import print_table
    with_model = any("margin" in r["figures"] for r in records)
    headers = ["source", "loader", "images/s", "min-max", "MB/s", "cores busy", "first batch"]
    if with_model:
        headers += ["vs model", "fed images/s", "fed/synthetic"]
    rows = []
    for r in records:
        f = r["figures"]
        if r["status"] != "ok":
            rows.append([r["source_label"], r["loader"], "error", r["error"][:60],
                         *["-"] * (len(headers) - 4)])
            continue
        rate = f["images_per_s"]
        row = [r["source_label"], r["loader"], f"{rate['median']:,.0f}",
               f"{rate['min']:,.0f}-{rate['max']:,.0f}", f"{f['mb_per_s']:,.1f}",
               f"{f['cpu_cores']:.2f} ({f['cpu_percent']:.0f}%)", f"{f['first_batch_s']:.2f} s"]
        if with_model:
            row += ([_verdict(f["margin"], r["device"]),
                     f"{f['fed_images_per_s']['median']:,.0f}",
                     f"{100 * f['fed_fraction']:.0f}%"] if "margin" in f else ["-"] * 3)
        rows.append(row)
    title = f"data bench on {records[0]['device']}, batch {records[0]['batch_size']}" \
        if records else "data bench"
    model = next((r for r in records if "model_synthetic_images_per_s" in r["figures"]), None)
    if model is not None:
        title += (f"; {model['model']['workload']} on synthetic on-device batches: "
                  f"{model['figures']['model_synthetic_images_per_s']['median']:,.0f} images/s")
    print_table(headers, rows, title=title + "  [images/s: median of the windows]", file=file)


def _processes(loader: str) -> tuple[str, int]:
    """Where a loader stands on the chart's x axis: ``multiprocess:N`` and ``threads:N`` at N,
    the rest (serial, device, GPU decoding) at 0."""
    name, _, count = loader.partition(":")
    return name, int(count) if count.isdigit() and name in ("multiprocess", "threads") else 0


def plot_data_bench(records: list[dict], path: Path) -> Path | None:
    """images/s against loader processes: a line per source through its multiprocess:N
    points, other loaders as labelled markers, min-max whiskers, and the model's synthetic
    rate as a dashed line. None when nothing was measured."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7.0, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = list(dict.fromkeys(r["source_label"] for r in ok))
    for i, label in enumerate(labels):
        color, mine = f"C{i % 10}", [r for r in ok if r["source_label"] == label]
        line = sorted((_processes(r["loader"])[1], r) for r in mine
                      if _processes(r["loader"])[0] == "multiprocess")
        if line:
            _points(ax, line, color, "o-", f"{label} multiprocess")
        for r in mine:
            name, x = _processes(r["loader"])
            if name != "multiprocess":
                _points(ax, [(x, r)], color, "s" if name == "serial" else "^", None)
                ax.annotate(r["loader"], (x, r["figures"]["images_per_s"]["median"]),
                            textcoords="offset points", xytext=(5, 4), fontsize=7, color=color)
    model = next((r for r in ok if "model_synthetic_images_per_s" in r["figures"]), None)
    if model is not None:
        rate = model["figures"]["model_synthetic_images_per_s"]["median"]
        ax.axhline(rate, color="k", linestyle="--", linewidth=1,
                   label=f"{model['model']['workload']} on synthetic data: {rate:,.0f}/s")
    env = ok[0].get("env", {})
    gpu = f" + {env.get('device_name')}" if env.get("device_type") == "cuda" else ""
    ax.set_xlabel("loader processes (multiprocess:N, threads:N at N; in-process loaders at 0)")
    ax.set_ylabel("images/s (median of windows)")
    ax.set_title(f"Data loading on {env.get('cpu_name', '?')} ({env.get('cpu_count')} cores){gpu}, "
                 f"batch {ok[0]['batch_size']}\nwhiskers: min-max of the timed windows",
                 fontsize=9)
    ax.set_xticks(sorted({_processes(r["loader"])[1] for r in ok}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


def _points(ax, points, color, style, label) -> None:
    xs = [x for x, _ in points]
    rates = [r["figures"]["images_per_s"] for _, r in points]
    ys = [s["median"] for s in rates]
    err = [[y - s["min"] for y, s in zip(ys, rates)], [s["max"] - y for y, s in zip(ys, rates)]]
    ax.errorbar(xs, ys, yerr=err, fmt=style, color=color, capsize=2, label=label)


def read_data_bench(out: Path) -> list[dict]:
    """The latest record of each (source, loader, batch size, device) in
    ``out/data_bench.jsonl`` (or that file itself), in the order they were first measured."""
    path = Path(out)
    path = path / RESULTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--report: no {RESULTS_FILE} in {out}; run the bench first")
    latest: dict = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                key = (r["source_label"], r["loader"], r["batch_size"], r["device"])
                latest[key] = r  # a key keeps its first place, with its latest record
    return list(latest.values())


def report_data_bench(out: Path, file=None) -> Path | None:
    """Table and chart from ``out/data_bench.jsonl`` alone; returns the chart's path."""
    records = read_data_bench(out)
    print_data_bench(records, file=file)
    return plot_data_bench(records, Path(out) / CHART_FILE)

