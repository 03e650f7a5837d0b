"""Train a registered workload: the library call behind ``kasoku train``."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from kasoku.accel.compose import accelerate
from kasoku.accel.config import AccelConfig
from kasoku.config import DataConfig, TrainConfig
from kasoku.errors import ConfigError
from kasoku.optim import make_optimizer
from kasoku.workloads import Workload, create_workload


def resolve_device(spec: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a clear error when CUDA is asked for but absent."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"unknown device {spec!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {spec}: this PyTorch sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), numbered from 0")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {spec!r} is not supported yet; use cpu or cuda")
    return device


def build_trainer(workload: Workload, data: DataConfig, train: TrainConfig,
                  accel: AccelConfig | None = None):
    """Model, data, optimizer, schedule, the acceleration levers of ``accel`` and the standard
    extensions of ``kasoku train``."""
    from kasoku.data.prefetch import wrap_for_device
    from kasoku.train import Trainer
    from kasoku.train import extensions as ext

    recipe = workload.recipe
    epochs = train.epochs if train.epochs is not None else recipe.epochs
    batch_size = train.batch_size if train.batch_size is not None else recipe.batch_size
    lr = train.lr if train.lr is not None else recipe.lr
    if epochs <= 0 or batch_size <= 0:
        raise ConfigError(f"epochs and batch size must be positive, got {epochs} and {batch_size}")
    device = resolve_device(train.device)
    threads = train.threads if train.threads is not None else \
        (workload.cpu_threads if device.type == "cpu" else None)
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)

    accel = accel or AccelConfig()
    if accel.optimizer_impl == "triton" and recipe.optimizer == "adam" and device.type == "cuda":
        # Triton's start-up and the kernel's compilation overlap with loading the data.
        from kasoku.accel.triton_adam import compile_early
        compile_early(device, weight_decay=recipe.weight_decay != 0)
    torch.manual_seed(train.seed)
    train_set, val_set = workload.build_datasets(data, seed=train.seed)
    metric_fn = workload.metric_fn if workload.has_accuracy else None
    accelerated = accelerate(
        workload.build_model(), workload.loss_fn, metric_fn, accel, device,
        lambda params, impl: make_optimizer(recipe.optimizer, params, lr, impl=impl,
                                            momentum=recipe.momentum,
                                            weight_decay=recipe.weight_decay))
    model, optimizer = accelerated.model, accelerated.optimizer
    # The step takes chunks of steps_per_call batches (MultiStep): the loader makes them.
    # On CUDA, host batches are copied ahead on a side stream (DevicePrefetcher).
    loader = _make_loader(train.loader, train_set, batch_size, device, seed=train.seed,
                          batches_per_call=accel.steps_per_call, prefetch=train.prefetch)
    loader = wrap_for_device(loader, device)
    if accel.cuda_graph and device.type == "cuda" and accel.steps_per_call > 1:
        _warn_short_chunks(accel.steps_per_call, loader.full_batches_per_epoch)
    trainer = Trainer(model, optimizer, loader, workload.loss_fn, metric_fn=metric_fn,
                      device=device, stop_trigger=(epochs, "epoch"), out=train.out,
                      step_fn=accelerated.step_fn)
    for extension in accelerated.extensions:
        trainer.extend(extension)

    for schedule in _schedules(recipe, epochs):
        trainer.extend(schedule)
    if val_set is not None:
        # Evaluation needs no small batches; with the dataset resident on the device, a few
        # large ones (MNIST's 10,000 in 10) cost a fraction of a hundred small ones' launches;
        # a recipe may take more at once (mnist-mlp: all 10,000).
        val_batch = recipe.eval_batch_size or \
            max(batch_size, 1000 if train.loader == "device" else 100)
        val_loader = _make_loader(train.loader, val_set, val_batch, device,
                                  shuffle=False, repeat=False, prefetch=train.prefetch)
        val_loader = wrap_for_device(val_loader, device)
        trainer.extend(ext.Evaluator(val_loader, model, workload.loss_fn, metric_fn=metric_fn,
                                     device=device))
    log_trigger = (train.log_interval, "iteration") if train.log_interval else (1, "epoch")
    trainer.extend(ext.LogReport(trigger=log_trigger))
    trainer.extend(ext.PrintReport(_print_entries(workload, val_set is not None)))
    trainer.extend(ext.SkippedReport())
    trainer.extend(ext.FailOnNonNumber(), trigger=log_trigger)
    trainer.extend(ext.PlotReport(["main/loss", "validation/main/loss"], filename="loss.png"),
                   trigger=log_trigger)
    if workload.has_accuracy:
        trainer.extend(ext.PlotReport(["main/accuracy", "validation/main/accuracy"],
                                      filename="accuracy.png"), trigger=log_trigger)
    snap_trigger = (train.snapshot_interval, "iteration") if train.snapshot_interval \
        else (1, "epoch")
    trainer.extend(ext.Snapshot(), trigger=snap_trigger)
    if train.progress:
        trainer.extend(ext.ProgressBar())
    return trainer


def _make_loader(kind: str, dataset, batch_size: int, device: torch.device,
                 batches_per_call: int = 1, prefetch: int | None = None, **kwargs):
    """The loader ``kind`` names (``--loader``); ``prefetch``: batches in flight (see
    ``TrainConfig.prefetch``), for the kinds that make batches ahead."""
    from kasoku.data.device_loader import ChunkedLoader, DeviceLoader
    from kasoku.data.loader import SerialLoader
    name, count = _parse_loader(kind)
    if prefetch is not None:
        if name not in PREFETCHING:
            raise ConfigError(f"--prefetch {prefetch}: the {name} loader makes each batch when "
                              f"it is asked for one and keeps none in flight; it applies to "
                              f"{', '.join(PREFETCHING)}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(f"--prefetch must be a whole number >= 1, got {prefetch!r}")
        kwargs["prefetch_batches"] = prefetch
    if batches_per_call > 1 and name not in ("serial", "device"):
        raise ConfigError(f"--steps-per-call {batches_per_call} needs a loader that hands out "
                          f"several batches per call; use --loader serial or --loader device, "
                          f"or drop --steps-per-call")
    if name == "serial":
        if batches_per_call > 1:
            return ChunkedLoader(dataset, batch_size, batches_per_call=batches_per_call,
                                 **kwargs)
        return SerialLoader(dataset, batch_size, **kwargs)
    if name == "device":
        try:
            return DeviceLoader(dataset, batch_size, device=device,
                                batches_per_call=batches_per_call, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"--loader device: {exc}")
    if name == "gpu-jpeg":
        from kasoku.data.gpu_jpeg import GpuJpegLoader
        try:
            return GpuJpegLoader(dataset, batch_size, device=device, num_threads=count, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--loader {kind}: {exc}")
    if name == "gpu-jpeg-procs":
        from kasoku.data.gpu_jpeg_procs import GpuJpegProcessLoader
        try:
            return GpuJpegProcessLoader(dataset, batch_size, device=device, num_workers=count,
                                        **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--loader {kind}: {exc}")
    from kasoku.data.parallel_loader import ProcessLoader, ThreadLoader
    if name == "threads":
        return ThreadLoader(dataset, batch_size, num_threads=count, **kwargs)
    return ProcessLoader(dataset, batch_size, num_workers=count,
                         pin_memory=device.type == "cuda", **kwargs)


_LOADERS = ("serial", "device", "threads", "multiprocess", "gpu-jpeg", "gpu-jpeg-procs")
_COUNTED = ("threads", "multiprocess", "gpu-jpeg", "gpu-jpeg-procs")
PREFETCHING = _COUNTED
"""The loader kinds that make batches ahead (``--prefetch``)."""


def _parse_loader(kind: str) -> tuple[str, int | None]:
    """``"threads:8" -> ("threads", 8)``; the count (threads, processes, reading threads for
    gpu-jpeg, decoding processes for gpu-jpeg-procs) is for those four kinds only."""
    name, _, count = kind.partition(":")
    if name not in _LOADERS or (count and name not in _COUNTED):
        raise ConfigError(f"unknown loader {kind!r}; use serial, device, threads[:N], "
                          f"multiprocess[:N], gpu-jpeg[:N] or gpu-jpeg-procs[:N]")
    if not count:
        return name, None
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--loader {kind}: N must be a whole number >= 1, got {count!r}")
    return name, int(count)


def _warn_short_chunks(steps_per_call: int, full_batches: int) -> None:
    from kasoku.accel.multistep import short_chunk_advice
    from kasoku.accel.notes import warn_once
    advice = short_chunk_advice(steps_per_call, full_batches)
    if advice is not None:
        warn_once(advice)


def _schedules(recipe, epochs: float) -> list:
    from kasoku.train import extensions as ext
    if recipe.schedule == "none":
        inner = None
    elif recipe.schedule == "cosine":
        inner = ext.CosineLR(total_epochs=epochs)
    elif recipe.schedule == "step":
        inner = ext.StepLR(step_size_epochs=max(1, int(epochs * 0.3)), gamma=0.1)
    else:
        raise ConfigError(f"unknown schedule {recipe.schedule!r}; use none, step or cosine")
    if recipe.warmup_epochs > 0:
        return [ext.LinearWarmup(recipe.warmup_epochs, inner=inner)]
    return [inner] if inner is not None else []


def _print_entries(workload: Workload, has_val: bool) -> list[str]:
    entries = ["epoch", "main/loss", "validation/main/loss", "main/accuracy",
               "validation/main/accuracy", "elapsed_time"]
    if not workload.has_accuracy:
        entries = [e for e in entries if not e.endswith("accuracy")]
    if not has_val:
        entries = [e for e in entries if not e.startswith("validation/")]
    return entries


def train_workload(name: str, data: DataConfig, train: TrainConfig,
                   resume: Path | None = None, accel: AccelConfig | None = None):
    """Train workload ``name``; returns the trainer (its LogReport holds the figures)."""
    workload = create_workload(name)
    trainer = build_trainer(workload, data, train, accel)
    if resume is not None and not Path(resume).exists():
        raise ConfigError(f"--resume: no snapshot at {resume}; train without --resume first, "
                          f"or give the snapshot's path")
    source = "synthetic" if data.synthetic else str(data.root)
    print(f"# workload: {name}  data: {source}  device: {train.device}  out: {train.out}",
          file=sys.stderr)
    try:
        trainer.run(resume=resume)
    finally:
        # Worker processes and threads of the parallel loaders end here, on every path.
        close = getattr(trainer.train_loader, "close", None)
        if close is not None:
            close()
    return trainer
