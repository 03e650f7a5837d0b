"""``kasoku scale``: argv -> ``ScaleConfig`` and the worker counts ->
``kasoku.commands.scale.run_scale``; prints the table and the explanation, draws the chart.

    kasoku scale imagenet-resnet50 --gpus 1,2,4 --batch-size 256
    kasoku scale mnist-mlp --procs 1,2
    kasoku scale mnist-mlp --procs 1,2 --data ../shared/data/mnist --loader multiprocess

The engine is imported where the command runs: the parser loads no torch.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kasoku.cli import args as a
from kasoku.cli.bench import _rung_spec
from kasoku.cli.train import WORKLOAD_HELP, add_workload_settings, workload_spec
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.data.registry import DEFAULT_LOADER
from kasoku.distributed import World, require_single_process
from kasoku.distributed.config import ALLREDUCE_DTYPES, NUMA_BINDINGS, DistConfig
from kasoku.distributed.plan import plan_worlds
from kasoku.train.run_dir import out_or_new
from kasoku.workloads import create_workload
from kasoku.workloads.registry import default_batch_sizes

if TYPE_CHECKING:
    from kasoku.commands.bench.rungs import Rung

GPU_DEFAULTS = {"steps": 20, "warmup": 15}
CPU_DEFAULTS = {"steps": 20, "warmup": 5}
CPU_DEFAULT_RUNG = "+fused"
"""On a CPU: the fastest rung that needs no compiler (each worker count would compile anew)."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "scale", help="data-parallel scaling: throughput on 1, 2, 4... workers, and what "
        "limits it",
        description="Train a workload on synthetic batches (or with --data, each worker "
        "reading its shard of the dataset through a loader) with 1, 2, 4... data-parallel "
        "workers (PyTorch's DDP; a process per GPU over NCCL, or CPU processes over gloo), "
        "each count in its own launch of PyTorch's elastic launcher, the batch per worker "
        "fixed. Per count: throughput, scaling efficiency over one worker without DDP, the "
        "step time without DDP, the all-reduce time not hidden behind the backward pass, "
        "and one line on what limits the scaling. With --shard the data-parallel step is "
        "FSDP2's instead (its all-gathers and reduce-scatters timed alone; on CUDA each GPU's "
        "peak memory). Appends OUT/results.jsonl, draws OUT/scale.png; exits 1 when a "
        "worker fails.")
    p.add_argument("workload", help=WORKLOAD_HELP)
    world = p.add_mutually_exclusive_group()
    world.add_argument("--gpus", type=a.int_list, metavar="N[,N...]",
                       help="worker counts on GPUs, a process per GPU over NCCL (default with "
                       "CUDA: 1 and every visible GPU)")
    world.add_argument("--procs", type=a.int_list, metavar="N[,N...]",
                       help="worker counts of CPU processes over gloo, each with cores / N "
                       "threads (default without CUDA: 1,2)")
    p.add_argument("--device", type=a.device, default="auto", metavar="{auto,cpu,cuda}",
                   help="where the workers run: auto (GPUs when CUDA is there, else CPU "
                   "processes), cpu (as --procs) or cuda (as --gpus); the counts from --procs "
                   "or --gpus (default: auto)")
    p.add_argument("--batch-size", type=a.int_list, metavar="N[,N...]",
                   help="batch size per worker, or several to compare (default: the "
                   "workload's recipe)")
    p.add_argument("--config", type=_rung_spec, metavar="SPEC",
                   help="the step's levers: a ladder label (plain, amp, +compile, ...) or "
                   "settings as `kasoku train` names them, e.g. precision=bf16,channels_last "
                   f"(default: the device's top rung on a GPU, {CPU_DEFAULT_RUNG} on a CPU)")
    p.add_argument("--data", type=Path, metavar="DIR",
                   help="the workload's dataset (the folder `kasoku train --data` reads): each "
                   "worker reads its shard of the training split through --loader, inside the "
                   "timed steps, and the time a step waits for its batch is measured (default: "
                   "synthetic batches already on the device)")
    p.add_argument("--loader", type=a.loader_spec, metavar="KIND[:N]",
                   help="the loader of --data, as `kasoku train --loader` takes it (default: "
                   f"{DEFAULT_LOADER})")
    p.add_argument("--steps", type=a.positive_int,
                   help="steps per timed window (default 20)")
    p.add_argument("--windows", type=a.positive_int, default=5,
                   help="timed windows per measurement; the median is reported (default 5)")
    p.add_argument("--warmup", type=a.nonnegative_int,
                   help="warm-up steps before the windows, not timed (default: 15 GPU, 5 CPU)")
    p.add_argument("--threads", type=a.threads,
                   help="CPU threads per worker (default: the cores / the worker count)")
    p.add_argument("--seed", type=a.seed, default=0, help="seed for weights and batches")
    a.add_fields(p, DistConfig, {
        "bucket_mb": {"metavar": "MB"}, "static_graph": None,
        "allreduce_dtype": {"choices": ALLREDUCE_DTYPES},
        "dist_timeout": {"metavar": "SECONDS"}, "shard": None,
        "numa_binding": {"choices": NUMA_BINDINGS}})
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for results.jsonl (appended) and scale.png (default: a new "
                   "folder runs/scale-WORKLOAD-DATE-TIME)")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    add_workload_settings(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    """Plan, measure, report. Returns 0, or 1 when a worker failed; a request this machine
    cannot run raises ``ConfigError`` before any folder is made."""
    from kasoku.commands.scale import (  # deferred: torch (module doc)
        CHART_FILE,
        RESULTS_FILE,
        WorkersFailed,
        plot_scale,
        print_results,
        run_scale,
    )
    from kasoku.commands.scale_feed import check_data  # deferred: torch (module doc)

    # It launches its own processes: started as one of several, each would launch a set.
    require_single_process(World.from_env(), "kasoku scale")
    wl = create_workload(workload_spec(args))
    plan = plan_worlds(*counts_on(args.device, args.gpus, args.procs), from_one=True)
    cfg = scale_config(args, wl, plan.device_type)
    batch_sizes = args.batch_size or list(default_batch_sizes(wl.recipe.batch_size, "scale"))
    check_data(wl, args.data, args.loader, batch_sizes, plan.world_sizes, args.seed)
    out = out_or_new(args.out, wl.name, "scale", "the results and the chart")
    failed = None
    for b in batch_sizes:
        one = dataclasses.replace(cfg, batch_size=b)
        try:
            records = run_scale(one, plan.backend, plan.world_sizes, out)
        except WorkersFailed as exc:
            print(f"kasoku: error: {exc}", file=sys.stderr, flush=True)
            failed = exc
            break
        print_results(records)
        if not args.no_chart:
            name = CHART_FILE if len(batch_sizes) == 1 else f"scale-batch{b}.png"
            print(f"chart: {plot_scale(records, out / name)}")
    print(f"results: {out / RESULTS_FILE}")
    return 1 if failed else 0


def counts_on(device: str, gpus: list[int] | None, procs: list[int] | None
              ) -> tuple[list[int] | None, list[int] | None]:
    """``(gpus, procs)`` for ``plan_worlds`` with ``--device``: auto leaves the choice to
    the counts given (else to CUDA's presence); cpu and cuda choose the kind of worker, and
    refuse counts of the other kind. ``ConfigError`` saying what to give otherwise."""
    if device == "auto":
        return gpus, procs
    if device == "cpu":
        if gpus:
            raise ConfigError("--gpus runs a worker per GPU: with --device cpu give the CPU "
                              "processes' counts as --procs N[,N...]")
        return None, procs or [1, 2]
    if device != "cuda":
        raise ConfigError(f"--device {device}: scale places a worker on each GPU itself; give "
                          "--device cuda, and --gpus N[,N...] for the counts")
    if procs:
        raise ConfigError("--procs runs CPU processes: with --device cuda give the GPU counts "
                          "as --gpus N[,N...]")
    import torch  # deferred: torch (module doc)
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no GPU here; give --device cpu (CPU "
                          "processes over gloo)")
    return gpus, None


def _shardable(rung: Rung, wl) -> bool:
    """Whether FSDP2 can take ``rung``'s step (``check_sharding``: no graph, ...)."""
    from kasoku.accel.compose import check_sharding  # deferred: torch (module doc)
    if rung.is_plain:
        return True
    try:
        check_sharding(rung.config, wl.recipe.optimizer)
    except ConfigError:
        return False
    return True


def scale_config(args, wl, device_type: str):
    """The ``ScaleConfig`` of parsed arguments (the batch size set per run)."""
    from kasoku.accel.checkpointing import checkpointable_blocks  # deferred: torch
    from kasoku.accel.compose import check_sharding  # deferred: torch (module doc)
    from kasoku.accel.memory_format import has_conv2d  # deferred: torch (module doc)
    from kasoku.commands.bench.rungs import (  # deferred: torch (module doc)
        default_ladder,
        resolve,
        rung_from_spec,
    )
    from kasoku.commands.scale import ScaleConfig  # deferred: torch (module doc)

    dist = a.config_from(args, DistConfig, gpus=None, procs=None)  # the counts are lists here
    dist.check()
    if dist.numa_binding and device_type != "cuda":
        raise ConfigError(f"{flag('dist.numa_binding')} binds the workers of "
                          f"{flag('dist.gpus')} N to CPUs near their GPUs; these are CPU "
                          f"processes")
    if args.config:
        rung = rung_from_spec(args.config, device_type, wl.ladder)
    elif device_type == "cuda":
        rung = next(r for r in reversed(default_ladder("cuda", wl.ladder))
                    if not r.skip and (not dist.shard or _shardable(r, wl)))
    else:
        rung = rung_from_spec(CPU_DEFAULT_RUNG, "cpu")
    if dist.shard and not rung.is_plain:
        check_sharding(rung.config, wl.recipe.optimizer)
    model = wl.build_model()  # what applies to it, as the bench resolves its rungs
    (rung,), _ = resolve([rung], device_type, has_conv2d(model),
                         checkpointable_blocks(model) is not None)
    defaults = GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS
    return ScaleConfig(workload=workload_spec(args), label=rung.label, shard=dist.shard,
                       config=rung.config_dict(),
                       batch_size=wl.recipe.batch_size, steps=args.steps or defaults["steps"],
                       windows=args.windows,
                       warmup=args.warmup if args.warmup is not None else defaults["warmup"],
                       seed=args.seed, threads=args.threads, bucket_mb=dist.bucket_mb,
                       static_graph=dist.static_graph, allreduce_dtype=dist.allreduce_dtype,
                       timeout_s=dist.dist_timeout, numa_binding=dist.numa_binding,
                       data=str(args.data.resolve()) if args.data is not None else None,
                       loader=args.loader)
