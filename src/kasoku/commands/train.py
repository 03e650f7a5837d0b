"""Train a workload: the library call behind ``kasoku train``.

``train_run`` = pick the run folder (``kasoku.train.run_dir``), ``build_trainer`` (data,
model, levers, loader, and the standard extensions of ``kasoku.train.standard``), run.
Everything a lever needs is decided by ``kasoku.accel.accelerate``; every loader comes from
``kasoku.data.registry``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch

from kasoku.accel.compose import accelerate, prewarm
from kasoku.accel.config import AccelConfig
from kasoku.accel.loader_cores import describe as describe_cores
from kasoku.accel.loader_cores import loader_split, release_cores
from kasoku.accel.loss_scale import PrecisionState
from kasoku.accel.lr_rules import goyal_warmup_epochs, linear_scaling_lr
from kasoku.commands.device import resolve_device
from kasoku.commands.job import join_as_worker, leave_job
from kasoku.commands.resume import resumed_settings
from kasoku.core.errors import KasokuWarning, warn_once
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.data.prefetch import wrap_for_device
from kasoku.data.registry import accepts, create_loader, loader_kind
from kasoku.distributed import World, ddp, fsdp
from kasoku.distributed.config import DistConfig
from kasoku.distributed.ddp import local_world_size
from kasoku.distributed.launch import under_launcher
from kasoku.kfac import KFACConfig
from kasoku.optim import make_optimizer
from kasoku.run import RunConfig, resolve
from kasoku.train import Trainer, load_snapshot
from kasoku.train import extensions as ext
from kasoku.train.config import TrainConfig
from kasoku.train.run_dir import default_out, saved_line
from kasoku.train.run_dir import resolve_run as resolve_run_dir
from kasoku.train.signals import defer_signals
from kasoku.train.standard import (
    extend_reports,
    log_trigger,
    schedules,
    snapshot_trigger,
)
from kasoku.workloads import Workload, create_workload


def build_trainer(workload: Workload, data: DataConfig, train: TrainConfig,
                  accel: AccelConfig | None = None, out: Path | None = None,
                  seed: int | None = None, world: World | None = None,
                  dist_cfg: DistConfig | None = None, kfac: KFACConfig | None = None
                  ) -> Trainer:
    """Data, model, optimizer, schedule, the levers of ``accel``, the loader and the standard
    extensions of ``kasoku train``, writing to ``out`` (default ``train.out``); ``seed``
    replaces ``train.seed`` (a resume builds with its snapshot's). The optimizer is
    ``train.optimizer`` or else the recipe's; ``kfac`` configures optimizer kfac (default
    ``KFACConfig()``). The settings are resolved and checked as ``kasoku train``'s
    (``kasoku.run``), then ``build_run`` builds.

    ``world``/``dist_cfg``: this process is one worker of a data-parallel run whose process
    group is joined (``kasoku.distributed.ddp.join``): the model is wrapped in DDP before it is
    compiled, each loader yields this worker's shard, evaluation sums over all workers, and
    only worker 0 logs, prints and plots (every worker takes part in a snapshot; worker 0
    writes it). ``train.batch_size`` is per worker. A CPU loader split pins this process
    (``loader_cores``): ``close_run(trainer)`` when done; a failed build unpins itself."""
    run = resolve(workload, data, train, accel, dist_cfg, kfac)
    run.check()
    return build_run(run, workload, out=out, seed=seed, world=world,
                     parallel=dist_cfg is not None)


def build_run(run: RunConfig, workload: Workload, out: Path | None = None,
              seed: int | None = None, world: World | None = None, parallel: bool = False
              ) -> Trainer:
    """``build_trainer`` of a checked ``run`` (``RunConfig.check``) and the ``workload`` its
    spec makes; ``parallel``: this process is one worker of a data-parallel run configured
    by ``run.dist``."""
    train, accel, recipe = run.train, run.accel, workload.recipe
    world = world or World()
    epochs, batch_size, lr, optimizer = train.epochs, train.batch_size, train.lr, train.optimizer
    if optimizer != recipe.optimizer and "lr" not in run.given:
        warn_once(f"optimizer {optimizer}: the learning rate is the workload's {lr:g}, tuned "
                  f"for its {recipe.optimizer}; pass {flag('train.lr')} to set one for {optimizer}")
    if run.kfac is not None and optimizer != "kfac":
        warn_once(f"the K-FAC settings have no effect: the optimizer is {optimizer}, not kfac")
    warmup_epochs = recipe.warmup_epochs
    if parallel and run.dist.scale_lr and world.world_size > 1:
        # The recipe's rate is for its batch; the global batch is world x the per-worker one.
        lr = linear_scaling_lr(lr, batch_size * world.world_size, base_batch=batch_size)
        warmup_epochs = max(warmup_epochs, min(goyal_warmup_epochs(
            batch_size * world.world_size, base_batch=batch_size), epochs / 2))
    device = resolve_device(train.device)
    seed = seed if seed is not None else train.seed
    threads = train.threads or (workload.cpu_threads if device.type == "cpu" else None)
    if parallel and device.type == "cpu" and not threads:
        # The workers of one machine share its cores.
        threads = max(1, (os.cpu_count() or 1) // local_world_size())
    # Before the loaders are built: the split pins every thread this process has by then.
    cores = None if parallel else loader_cores(train, device, threads)
    worker_cpus = (cores or {}).get("loader_cpus")
    if threads and not worker_cpus:
        torch.set_num_threads(threads)
    pinned = {"worker_cpus": worker_cpus} if worker_cpus else {}
    built: list = []  # the loaders made so far, closed if building fails
    try:
        # overlaps loading the data
        prewarm(accel.optimizer_impl, device, optimizer, recipe.weight_decay)
        torch.manual_seed(seed)
        train_set, val_set = workload.build_datasets(run.data, seed=seed)
        train = held_synthetic(train, run.data, train_set, val_set)
        if batch_size > len(train_set):
            warn_once(f"batch size {batch_size} is larger than the {len(train_set)} training "
                      f"samples: each step takes all of them")
        metric_fn = workload.metric_fn if workload.has_accuracy else None
        model = workload.build_model()
        if world.world_size > 1:
            # The same weights everywhere (DDP also broadcasts worker 0's), then a random stream of
            # each worker's own (dropout masks differ between shards).
            torch.manual_seed(seed + 1_000_003 * world.rank)
        # K-FAC hooks the layers of ``model`` as they are when accelerate builds the optimizer:
        # after its in-place levers (it refuses compile), and inside DDP: accelerate wraps its own
        # reference, this closure keeps the inner module.
        accelerated = accelerate(
            model, workload.loss_fn, metric_fn, accel, device,
            lambda params, impl: make_optimizer(optimizer, params, lr, impl=impl,
                                                momentum=recipe.momentum,
                                                betas=recipe.betas,
                                                weight_decay=recipe.weight_decay,
                                                model=model, kfac=run.kfac),
            distribute=fsdp.data_parallel(run.dist, device, accel.precision) if parallel
            else None,
            grad_clip=train.grad_clip, checked=True)
        model = accelerated.model
        _share_loss_scale(accelerated)
        shard = {"rank": world.rank, "world_size": world.world_size} if world.world_size > 1 else {}
        # On CUDA, host batches are copied ahead on a side stream (DevicePrefetcher).
        loader = wrap_for_device(create_loader(
            train.loader, train_set, batch_size, device, seed=seed,
            batches_per_call=accelerated.batches_per_call, prefetch=train.prefetch, **pinned,
            **shard), device)
        built.append(loader)
        run_info = {"workload": workload.name, "batch_size": batch_size, "optimizer": optimizer}
        trainer = Trainer(model, accelerated.optimizer, loader, workload.loss_fn,
                          metric_fn=metric_fn, device=device, stop_trigger=(epochs, "epoch"),
                          out=out or train.out or default_out(workload.name),
                          step_fn=accelerated.step_fn, overwrite=train.overwrite,
                          run_info=run_info, writer=world.is_main)
        if cores is not None:
            trainer.setup["cpu_threads"] = cores
        for extension in [*accelerated.extensions, *schedules(recipe, epochs, warmup_epochs)]:
            trainer.extend(extension)
        if val_set is not None:
            # Evaluation needs no small batches; with the dataset resident on the device, a few
            # large ones (MNIST's 10,000 in 10) cost a fraction of a hundred small ones' launches;
            # a recipe may take more at once (mnist-mlp: all 10,000).
            val_batch = recipe.eval_batch_size or \
                max(batch_size, 1000 if train.loader == "device" else 100)
            # Each worker evaluates its share of the samples, none twice (no padding); the
            # Evaluator sums over the workers. The model unwrapped: evaluation needs no DDP.
            val_shard = dict(shard, pad=False) if shard else {}
            val_loader = wrap_for_device(create_loader(
                train.loader, val_set, val_batch, device, shuffle=False, repeat=False,
                prefetch=train.prefetch, **pinned, **val_shard), device)
            built.append(val_loader)
            trainer.extend(ext.Evaluator(val_loader, ddp.unwrap(model), workload.loss_fn,
                                         metric_fn=metric_fn, device=device))
        if world.is_main:
            extend_reports(trainer, workload, train, has_val=val_set is not None)
        else:  # the other workers take part in snapshots (their RNG states), write no log
            trainer.extend(ext.FailOnNonNumber(), trigger=log_trigger(train))
            trainer.extend(ext.Snapshot(), trigger=snapshot_trigger(train))
            trainer.extend(ext.BadFileLog())  # their shards' bad files join worker 0's list
    except BaseException:
        for made in built:
            made.close()
        release_cores(cores)  # the caller's threads back where they were
        raise
    return trainer


def held_synthetic(train: TrainConfig, data: DataConfig, *datasets) -> TrainConfig:
    """``train`` as it is, or with the serial loader where synthetic data was to be held on
    the device (``cli.args.synthetic_loader``) and a split is too large to be held (said)."""
    if train.loader != "device" or not data.synthetic:
        return train
    kind = loader_kind("device")
    if all(accepts(kind, d) for d in datasets if d is not None):
        return train
    big = next(d for d in datasets if d is not None and not accepts(kind, d))
    size = f" ({big.nbytes / 2**30:.1f} GiB)" if hasattr(big, "nbytes") else ""
    warn_once(f"the synthetic samples{size} are too many to hold on the device: the serial "
              f"loader draws them on the host (a smaller "
              f"{flag('data.synthetic_train_size')} holds them there)")
    return dataclasses.replace(train, loader="serial")


def loader_cores(train: TrainConfig, device: torch.device, threads: int | None) -> dict | None:
    """On a CPU, the loader's workers on cores of their own and the step's ``threads`` on the
    others (``loader_split``; its record), unless ``train.loader_cores`` is off (the record
    says so); None where the loader runs no workers on the host, or off the CPU."""
    cores = loader_split(train.loader, device.type, train.loader_cores, threads)
    if cores is None and not train.loader_cores:
        warn_once(f"{flag('train.loader_cores')} has no effect: the {train.loader} loader on "
                  f"{device.type} gives no worker processes or threads cores of their own")
    return cores


def _share_loss_scale(accelerated) -> None:
    """An optimizer that reads gradients during the backward pass (K-FAC's G factors, through
    its ``loss_scale``) sees them multiplied by fp16's loss scale: hand it the scaler's scale
    tensor (updated in place after each step, so it is always the backward's)."""
    for extension in accelerated.extensions:
        if isinstance(extension, PrecisionState) and hasattr(accelerated.optimizer,
                                                               "loss_scale"):
            accelerated.optimizer.loss_scale = extension.scaler.scale_value


def train_run(run: RunConfig, resume=None) -> Trainer:
    """Train ``run``, a checked ``RunConfig`` (``kasoku.run.resolve``, ``RunConfig.check``),
    into ``run.train.out`` (a new folder under ``runs/`` when None); ``resume``: None,
    ``"auto"``, a run folder or a snapshot file. Returns the trainer (its LogReport holds the
    figures).

    In a process started by a launcher (``kasoku.distributed.launch.under_launcher``: kasoku's own
    ``--gpus``/``--procs``, torchrun, a scheduler) this is one worker of a data-parallel run,
    configured by ``run.dist``; a worker group the launcher restarted resumes from the run's
    latest snapshot."""
    device = resolve_device(run.train.device)
    workload = create_workload(run.workload)
    if under_launcher():
        return _train_worker(run, workload, resume, device)
    # What building says (a lever skipped here, a setting ignored) comes after the line that
    # names the run; a mistake found while building is the only line printed.
    failure, trainer = None, None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", KasokuWarning)
        try:
            trainer, out, snapshot, state = _start(run, workload, resume)
        except BaseException as exc:
            failure = exc
    said = list(said)  # the warnings are said again outside the recording
    if failure is not None:
        _say_again(said)
        raise failure
    cores = trainer.setup.get("cpu_threads")
    print(f"# {workload.name}  data: {_data_source(workload, run.data)}  device: {device}  "
          f"{_optimizer_words(run, workload)}  out: {out}"
          + (f"  cores: {describe_cores(cores)}" if cores else ""), file=sys.stderr, flush=True)
    _say_again(said)
    if snapshot is not None:
        trainer.resumed_from(snapshot)
        resumed_settings(trainer, run, state)
    _run_and_close(trainer)
    print(saved_line(out), file=sys.stderr, flush=True)
    return trainer


def _start(run: RunConfig, workload: Workload, resume, world: World | None = None
           ) -> tuple[Trainer, Path, Path | None, dict | None]:
    """What every run starts with: its folder located (in a data-parallel run, ``world``, by
    worker 0, which tells the others), its snapshot loaded, the trainer built with the
    snapshot's seed (a resumed run's data is built with it: synthetic and generated sets
    depend on it, whatever --seed says), and the snapshot's state loaded (another run's is
    refused before anything trains). Returns ``(trainer, out, snapshot, state)``. On a failure
    a built trainer is closed and, in one process, a run folder made here and left empty is
    removed."""
    parallel = world is not None
    existed = run.train.out is not None and Path(run.train.out).exists()
    out, trainer = None, None
    try:
        located = None
        if not parallel or world.is_main:
            if run.data.synthetic and run.data.root is not None:
                warn_once(f"{flag('data.synthetic')}: the data in {flag('data.root')} "
                          f"{run.data.root} is not read")
            located = resolve_run_dir(workload.name, run.train.out, resume, run.train.overwrite)
        out, snapshot = ddp.broadcast_object(located) if parallel else located
        state = load_snapshot(snapshot) if snapshot is not None else None
        seed = (state.get("loader") or {}).get("seed") if state is not None else None
        trainer = build_run(run, workload, out=out, seed=seed, world=world, parallel=parallel)
        if state is not None:
            trainer.load_state_dict(state, source=snapshot)
    except BaseException:
        if trainer is not None:  # built, then refused the snapshot: its loaders and cores
            close_run(trainer)
        if not parallel and out is not None and not existed and out.is_dir() \
                and not any(out.iterdir()):
            out.rmdir()  # nothing ran: leave no empty run folder behind
        raise
    return trainer, out, snapshot, state


def _optimizer_words(run: RunConfig, workload: Workload) -> str:
    """The update the run's first line names: ``adamw lr 0.001 betas 0.9,0.95 clip 1``."""
    train, recipe = run.train, workload.recipe
    betas = recipe.betas if train.optimizer in ("adam", "adamw") else None
    return (f"{train.optimizer} lr {train.lr:g}"
            + (f" betas {betas[0]:g},{betas[1]:g}" if betas else "")
            + (f" clip {train.grad_clip:g}" if train.grad_clip else ""))


def _data_source(workload: Workload, data: DataConfig):
    """What the run's first line says the data is."""
    return "synthetic" if data.synthetic else \
        "generated" if workload.generated_data else data.root or workload.default_data


def _run_and_close(trainer: Trainer) -> None:
    try:
        trainer.run()
    finally:
        close_run(trainer)


def close_run(trainer: Trainer) -> None:
    """End what a built trainer holds, on every path: the worker processes and threads of its
    parallel loaders; this process's threads go back to the CPUs the loader split took them
    from (``release_cores``)."""
    for loader in loaders_of(trainer):
        loader.close()
    release_cores(trainer.setup.get("cpu_threads"))


def _train_worker(run: RunConfig, workload: Workload, resume, device: torch.device
                  ) -> Trainer:
    """One worker of a data-parallel run (see ``train_run``)."""
    defer_signals()  # a Ctrl-C while the worker starts: kept for its first step
    world = World.from_env()
    run = dataclasses.replace(run, train=join_as_worker(world, run.train, run.dist, device))
    # Agreed by the workers as they joined, not the launcher's count (torchrun's c10d counts a
    # restart only on the machine whose worker failed).
    restarts = ddp.attempt()
    if restarts:
        resume = "auto"  # the job's workers were restarted: on from the latest snapshot
    device = torch.device(run.train.device)
    trainer = None
    try:
        trainer, out, snapshot, state = _start(run, workload, resume, world)
        if world.is_main:
            batch = trainer.run_info["batch_size"]
            kind = "GPUs" if device.type == "cuda" else "processes"
            print(f"# {workload.name}  data: {_data_source(workload, run.data)}  "
                  f"{world.world_size} {kind} "
                  f"({ddp.backend_for(device)}), batch {batch} per worker, "
                  f"{batch * world.world_size} in all  {_optimizer_words(run, workload)}  "
                  f"out: {out}"
                  + (f"  (restart {restarts})" if restarts else ""),
                  file=sys.stderr, flush=True)
        if snapshot is not None:
            if world.is_main:
                trainer.resumed_from(snapshot)
            else:
                trainer.last_snapshot_iteration = trainer.updater.iteration
            resumed_settings(trainer, run, state)
        _run_and_close(trainer)
        if world.is_main:
            print(saved_line(out), file=sys.stderr, flush=True)
        return trainer
    finally:
        leave_job(trainer, device)


def _say_again(caught: list) -> None:
    """Warn again with warnings recorded by ``warnings.catch_warnings(record=True)``."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def loaders_of(trainer: Trainer) -> list:
    """The loaders ``build_trainer`` made: the training one and the evaluator's."""
    loaders = [trainer.train_loader]
    for entry in trainer.extensions:
        if isinstance(entry.extension, ext.Evaluator):
            loaders.append(entry.extension.loader)
    return loaders
