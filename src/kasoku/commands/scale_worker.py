"""One worker of ``kasoku scale`` (``kasoku.commands.scale`` says what is measured and why):
``python -m kasoku.commands.scale_worker REQUEST_JSON``, started by the elastic launcher, joins the
process group from the launcher's environment, times the workload's step three ways and, as
rank 0, appends one record to the request's results file.

1. **alone**: the step without DDP, every worker running it at the same time (so the workers
   share the machine as they will in training, but exchange nothing);
2. **data-parallel**: the same step with the model wrapped in DDP (the buckets all-reduced
   during the backward pass);
3. **all-reduce alone**: the gradients' bytes all-reduced in DDP's bucket sizes, with nothing
   to overlap with.

With ``--shard`` the data-parallel step is FSDP2's (``kasoku.distributed.fsdp.shard``) and
the communication alone is its own: each unit's parameters all-gathered (in the forward, and
again in the backward but for the units kept whole after their forward: the last block and
the root) and its gradients reduce-scattered, in the unit sizes and dtypes FSDP2 uses.
Each step measurement also records the device's peak memory (the largest over the ranks).

Each timed window starts after a barrier and ends when this rank's device is done; a window's
time is the slowest rank's (a step is not done before its last worker is), the figure the
median over windows. Warm-up steps (compilation, autotuning, DDP's bucket rebuild, graph
capture) run before and are reported, not timed.

With ``--data DIR`` every step pulls its batch from this worker's shard through a loader
(``kasoku.commands.scale_feed``) in both step measurements, and the time it waited for it is
timed beside it (each window the slowest rank's wait per step).

Test hook (environment): ``KASOKU_SCALE_SIMULATE_FAILURE=RANK`` makes that rank fail after
the process group is up (and ``scale_feed`` has one for the samples read).
"""
from __future__ import annotations

import datetime as dt
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from kasoku.commands.bench.pool import batch_spec, cycle, make_pool
from kasoku.commands.bench.results import append_result
from kasoku.commands.bench.rungs import Rung
from kasoku.commands.bench.runner import StepRunner, make_runner
from kasoku.commands.bench.timing import EXTRA_BUDGET_S, EXTRA_WINDOWS
from kasoku.commands.scale import ScaleConfig, ScaleRequest
from kasoku.commands.scale_feed import SAMPLES_ENV, ShardFeed
from kasoku.core.queues import request_queues
from kasoku.distributed import ddp, fsdp
from kasoku.distributed.launch import failure_recorded, worker_main
from kasoku.distributed.world import World
from kasoku.perf.noise import MachineWatch, Stability, job_pids, spread
from kasoku.perf.sysinfo import environment
from kasoku.workloads import create_workload

SCHEMA = "kasoku.scale/1"
FAIL_ENV = "KASOKU_SCALE_SIMULATE_FAILURE"
COMM_REPS = 5
"""Timed repetitions of the all-reduce-alone measurement."""


def worker(request: ScaleRequest) -> None:
    """Measure ``request`` in this process, one rank of the job the launcher's environment
    describes; rank 0 appends the record to ``request.results``."""
    import torch
    import torch.distributed as dist

    world = World.from_env()
    device = ddp.worker_device(world, request.device_type)
    if device.type == "cpu":
        torch.set_num_threads(request.threads)
    ddp.join(world, device, request.scale.timeout_s)
    try:
        with failure_recorded():
            if os.environ.get(FAIL_ENV, "").strip() == str(world.rank):
                raise RuntimeError(f"simulated failure of rank {world.rank} ({FAIL_ENV})")
            record = measure(request, device, world.world_size)
            if world.rank == 0:
                append_result(request.results.parent, record, request.results.name)
    finally:
        dist.destroy_process_group()


def measure(request: ScaleRequest, device, world_size: int) -> dict:
    """The record of one world size (every rank computes it; rank 0's is written)."""
    import torch

    scale, cfg = request.scale, request.dist
    wl = create_workload(scale.workload)
    rung = Rung(scale.label, request.accel)
    rank = torch.distributed.get_rank()
    torch.manual_seed(scale.seed)
    batches, feed, data = _source(scale, wl, device, rank, world_size)
    notes: list[str] = []
    try:
        alone, _ = _time_steps(scale, wl, rung, device, batches, feed, notes,
                               distribute=None)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        wrapped, trained = _time_steps(scale, wl, rung, device, batches, feed, notes,
                                       distribute=fsdp.data_parallel(cfg, device,
                                                                     rung.config.precision))
        if feed is not None:
            data = feed.describe()
            if os.environ.get(SAMPLES_ENV):
                feed.save_seen(Path(os.environ[SAMPLES_ENV]))
    finally:
        if feed is not None:
            feed.close()
    if cfg.shard:
        comm = _time_shard_comm(trained, device, rung.config.precision)
    else:
        comm = _time_allreduce([p for p in trained.parameters() if p.requires_grad], cfg, device)
    step_ms, alone_ms = wrapped["step_ms"], alone["step_ms"]
    # With --data, what the data-parallel step waits for its batches beyond the step alone's
    # wait is the loaders' (sharing the host), not the all-reduce's.
    waits = (wrapped["data_wait_ms"], alone["data_wait_ms"])
    more_wait = 0.0 if None in waits else \
        min(max(0.0, waits[0] - waits[1]), max(0.0, step_ms - alone_ms))
    exposed_ms = max(0.0, step_ms - alone_ms - more_wait)
    b = scale.batch_size * wl.units_per_sample  # rates in the unit: tokens for gpt
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return {
        "schema": SCHEMA, "workload": scale.workload, "unit": wl.sample_unit,
        "world_size": world_size, "backend": torch.distributed.get_backend(),
        "device_type": device.type, "rung": rung.label, "config": rung.config_dict(),
        "batch_size_per_worker": scale.batch_size,
        "global_batch_size": scale.batch_size * world_size,
        "threads_per_worker": request.threads if device.type == "cpu" else None,
        "numa_binding": scale.numa_binding,
        "strategy": "fsdp2" if cfg.shard else "ddp",
        "comm": "all-gather + reduce-scatter" if cfg.shard else "all-reduce",
        "peak_mem_mb": wrapped["peak_mem_mb"], "alone_peak_mem_mb": alone["peak_mem_mb"],
        "bucket_mb": cfg.bucket_mb, "static_graph": cfg.static_graph,
        "allreduce_dtype": cfg.allreduce_dtype,
        "settings": {"steps": scale.steps, "windows": scale.windows, "warmup": scale.warmup,
                     "seed": scale.seed},
        "step_ms": step_ms, "step_ms_windows": wrapped["step_ms_windows"],
        "stability": wrapped["stability"], "alone_stability": alone["stability"],
        "alone_step_ms": alone_ms, "alone_step_ms_windows": alone["step_ms_windows"],
        "exposed_allreduce_ms": exposed_ms,
        "exposed_allreduce_pct": 100.0 * exposed_ms / step_ms if step_ms else 0.0,
        "allreduce_alone_ms": comm["ms"], "allreduce_buckets": comm["buckets"],
        "grad_mb": comm["bytes"] / 1e6,
        "samples_per_s": b * world_size / (step_ms / 1e3),
        "samples_per_s_per_worker": b / (step_ms / 1e3),
        "alone_samples_per_s_per_worker": b / (alone_ms / 1e3),
        "warmup_s": {"alone": alone["warmup_s"], "data_parallel": wrapped["warmup_s"]},
        "data": data, "data_wait_ms": wrapped["data_wait_ms"],
        "data_wait_ms_windows": wrapped["data_wait_ms_windows"],
        "alone_data_wait_ms": alone["data_wait_ms"], "more_data_wait_ms": more_wait,
        "timing": "perf_counter around a synchronize, slowest rank",
        "notes": list(dict.fromkeys(notes)), "env": environment(device), "time": now,
    }


def _source(scale: ScaleConfig, wl, device, rank: int, world_size: int):
    """``(batches(n, start), feed, data)``: with ``scale.data`` this worker's shard
    through the loader (``feed``, a ``ShardFeed``), else a pool of synthetic batches on the
    device (``feed`` None); ``data`` describes the source for the record."""
    if scale.data:
        feed = ShardFeed(wl, scale.data, scale.loader, scale.batch_size,
                         device, rank, world_size, seed=scale.seed,
                         record_samples=bool(os.environ.get(SAMPLES_ENV)))
        return feed.take, feed, None
    spec = batch_spec(wl, wl.build_model())
    # Each worker its own batches, as a sharded loader gives it.
    pool = make_pool(spec, scale.batch_size, device, 4, seed=scale.seed + rank)

    def batches(n: int, start: int):
        return cycle(pool, n, start)
    return batches, None, {"source": "synthetic on-device", **spec.describe()}


def _time_steps(scale: ScaleConfig, wl, rung, device, batches, feed, notes: list[str], distribute
                ) -> tuple[dict, object]:
    """Warm-up, then ``windows`` timed windows of ``steps`` steps of the rung's step (DDP's
    when ``distribute`` is given) on ``batches(n, start)``: the slowest rank's time per step
    of each window (and with a ``feed``, its wait for the batches), and the model the step
    trains (as wrapped)."""
    import torch

    torch.manual_seed(scale.seed)  # the same weights on every worker and in both runs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = wl.build_model().to(device)
    if rung.is_plain and distribute is not None:  # the plain loop has no levers to order
        model = distribute(model)
        distribute = None
    runner = make_runner(rung, wl, model, device, wl.recipe.lr, notes, distribute=distribute)
    steps, done = scale.steps, 0
    _barrier(device)
    t0 = time.perf_counter()
    for _ in range(max(1, scale.warmup)):
        runner(batches(1, done))
        done += 1
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if feed is not None:
        feed.wait_ms()  # the warm-up's waits (the loader's start) are not a window's
    windows, waits = [], []
    watch = MachineWatch(own=job_pids(), device=device).start()

    def window() -> None:
        nonlocal done
        _barrier(device)
        t0 = time.perf_counter()
        runner(batches(steps, done))
        _sync(device)  # note: the window ends when this rank's device is done
        windows.append((time.perf_counter() - t0) * 1e3 / steps)
        if feed is not None:
            waits.append(feed.wait_ms() / steps)
        done += steps

    for _ in range(scale.windows):
        window()
    slowest = _max_over_ranks(windows, device)
    # More windows while they disagree, up to twice as many again within their time: every
    # rank holds the same slowest times, so all decide alike (no exchange needed).
    budget_ms = min(1e3 * EXTRA_BUDGET_S, 2 * steps * sum(slowest))
    while (not spread(slowest).stable and budget_ms > 0
           and len(windows) < (1 + EXTRA_WINDOWS) * scale.windows):
        window()
        slowest = _max_over_ranks(windows, device)
        budget_ms -= steps * slowest[-1]
    stability = Stability(spread(slowest), watch.stop(),
                          len(windows) - scale.windows).to_dict()
    waited = _max_over_ranks(waits, device) if feed is not None else None
    peak = _max_over_ranks([torch.cuda.max_memory_allocated(device) / 1e6], device)[0] \
        if device.type == "cuda" else None
    return {"peak_mem_mb": peak, "step_ms": statistics.median(slowest), "step_ms_windows": slowest,
            "warmup_s": warmup_s, "stability": stability,
            "data_wait_ms": statistics.median(waited) if waited else None,
            "data_wait_ms_windows": waited}, \
        runner.model if isinstance(runner, StepRunner) else model


def _time_allreduce(params: list, cfg, device) -> dict:
    """The gradients all-reduced with nothing to overlap with: flat buffers of DDP's bucket
    size (``cfg.bucket_mb``) in the wire dtype (``cfg.allreduce_dtype``, else the
    parameters'), timed ``COMM_REPS`` times; the slowest rank's median, in ms."""
    import torch
    import torch.distributed as dist
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.allreduce_dtype,
                                                                 params[0].dtype)
    width = dtype.itemsize
    total = sum(p.numel() for p in params) * width
    cap = max(width, int(cfg.bucket_mb * 1e6 // width * width))
    sizes = [min(cap, total - start) for start in range(0, total, cap)]
    buffers = [torch.zeros(size // width, dtype=dtype, device=device) for size in sizes]

    def exchange():
        for buf in buffers:
            dist.all_reduce(buf)
    return {"ms": _timed(exchange, device), "buckets": len(buffers), "bytes": total}


def _time_shard_comm(model, device, precision: str) -> dict:
    """FSDP2's communication with nothing to overlap with: for each unit of ``model`` its
    parameters all-gathered in the dtype ``fsdp.shard``'s policy gives them for ``precision``
    (bf16 with bf16 on CUDA, else fp32) twice, once for the units kept whole after their
    forward (the last block, the root), and its fp32 gradients reduce-scattered; timed
    ``COMM_REPS`` times, the slowest rank's median, in ms."""
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    gather_dtype = fsdp.policy_dtypes(precision, device)[0] or torch.float32
    sizes = fsdp.unit_sizes(model)
    plan = []
    for i, size in enumerate(sizes):
        per_rank = -(-size // n)  # FSDP2 pads each shard to the same size
        for _ in range(1 if fsdp.kept_whole(i, len(sizes)) else 2):
            plan.append(("gather", torch.empty(per_rank, dtype=gather_dtype, device=device),
                         torch.empty(per_rank * n, dtype=gather_dtype, device=device)))
        plan.append(("scatter", torch.ones(per_rank * n, dtype=torch.float32, device=device),
                     torch.empty(per_rank, dtype=torch.float32, device=device)))

    # The *_single names from torch 2.12 on; the older ones are deprecated there.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def exchange():
        for kind, a, b in plan:
            (gather if kind == "gather" else scatter)(b, a)

    # bytes: the fp32 gradients, as for DDP (grad_mb)
    return {"ms": _timed(exchange, device), "buckets": len(plan), "bytes": 4 * sum(sizes)}


def _timed(exchange, device) -> float:
    """``exchange()`` once to warm up (the communicator's buffers for its sizes), then timed
    ``COMM_REPS`` times between a barrier and a synchronize: the slowest rank's median, in
    ms."""
    exchange()
    times = []
    for _ in range(COMM_REPS):
        _barrier(device)
        t0 = time.perf_counter()
        exchange()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(_max_over_ranks(times, device))


def _barrier(device) -> None:
    import torch.distributed as dist
    _sync(device)
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
    _sync(device)  # the barrier's own kernel is not timed


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(values: list[float], device) -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(argv: list[str] | None = None) -> None:
    """A worker: ``python -m kasoku.commands.scale_worker REQUEST_JSON`` under the launcher."""
    request_queues()
    worker_main(worker, sys.argv[1:] if argv is None else argv,
                "usage: python -m kasoku.commands.scale_worker REQUEST_JSON (started by kasoku "
                "scale, or torchrun)", parse=ScaleRequest.from_json)


if __name__ == "__main__":
    main()
