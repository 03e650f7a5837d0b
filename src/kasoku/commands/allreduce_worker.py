"""One worker of ``kasoku allreduce-bench`` (``kasoku.commands.allreduce_bench``, which says what is
measured and how): ``python -m kasoku.commands.allreduce_worker REQUEST_JSON``, started by the
elastic launcher (or torchrun), joins the process group from the launcher's environment,
measures each size and, as rank 0, appends a record per size to the request's results file.

Test hook (environment): ``KASOKU_ALLREDUCE_SIMULATE_FAILURE=RANK`` makes that rank fail after
the process group is up, so the failure path can be tested.
"""
from __future__ import annotations

import datetime as dt
import os
import statistics
import sys
import time

from kasoku.commands.allreduce_bench import (
    BACKEND_CHOICE,
    ELEMENT_BYTES,
    SCHEMA,
    AllReduceConfig,
    AllReduceRequest,
    bandwidths,
)
from kasoku.commands.bench.results import append_result
from kasoku.distributed.launch import failure_recorded, worker_main
from kasoku.perf.noise import Stability, spread
from kasoku.perf.sysinfo import environment

FAIL_ENV = "KASOKU_ALLREDUCE_SIMULATE_FAILURE"


def worker(request: AllReduceRequest) -> None:
    """Measure ``request.config.sizes`` in this process, one rank of a job the launcher's
    environment describes; rank 0 appends a record per size to ``request.results``."""
    import torch
    import torch.distributed as dist

    backend, cfg = request.backend, request.config
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    group = {"timeout": dt.timedelta(seconds=cfg.timeout_s)}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before the group: NCCL binds to this device
        device = torch.device("cuda", local_rank)
        group["device_id"] = device  # the communicator is made now, not in the first size
    else:
        device = torch.device("cpu")
        # One compute thread per process, as torchrun sets: idle OpenMP threads spinning
        # after the check's kernels would take cores from gloo's own threads.
        torch.set_num_threads(1)
    dist.init_process_group(backend, **group)
    try:
        with failure_recorded():
            rank, n = dist.get_rank(), dist.get_world_size()
            if os.environ.get(FAIL_ENV, "").strip() == str(rank):
                raise RuntimeError(f"simulated failure of rank {rank} ({FAIL_ENV})")
            shared = _shared_fields(request, device, n) if rank == 0 else {}
            for size in cfg.sizes:
                times_us, wrong = measure_size(size, cfg, device, n)
                if rank == 0:
                    append_result(request.results.parent,
                                  _record(shared, size, times_us, wrong, n), request.results.name)
    finally:
        dist.destroy_process_group()


def measure_size(size_bytes: int, cfg: AllReduceConfig, device, world_size: int):
    """``(times_us, wrong)``: per timed batch, the slowest rank's microseconds per
    all-reduce of ``size_bytes`` bytes; and the elements, over all ranks, that the check
    all-reduce got wrong. Every rank must call it with the same arguments."""
    import torch
    import torch.distributed as dist

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    buf = torch.ones(size_bytes // ELEMENT_BYTES[cfg.dtype], dtype=dtype, device=device)
    dist.all_reduce(buf)  # n ones summed: exact in every dtype for n <= 256
    wrong = (buf != world_size).sum().to(torch.float64)
    buf.zero_()
    for _ in range(cfg.warmup):
        dist.all_reduce(buf)
    def batches(reps: int) -> list[float]:
        times = torch.tensor([_timed_batch(buf, cfg.iters) / cfg.iters
                              for _ in range(reps)], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
        return times.tolist()

    times = batches(cfg.reps)
    # More batches while they disagree, up to twice as many again: every rank holds the same
    # slowest times, so all decide alike.
    while not spread(times).stable and len(times) < 3 * cfg.reps:
        times += batches(1)
    dist.all_reduce(wrong)
    return times, int(wrong.item())


def _timed_batch(buf, iters: int) -> float:
    """Microseconds of ``iters`` all-reduces of ``buf`` on this rank, started together."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    if buf.is_cuda:
        torch.cuda.synchronize()  # the barrier's own kernel is not timed
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(iters):
            dist.all_reduce(buf)  # the current stream waits for NCCL's: end follows the last
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) * 1e6


def _shared_fields(request: AllReduceRequest, device, world_size: int) -> dict:
    """What every record of this launch says besides its size's figures: the settings and
    where they were measured."""
    import torch
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    nccl = None
    cfg = request.config
    if request.backend == "nccl":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    algorithm = f"NCCL_ALGO={nccl_env['NCCL_ALGO']}" if request.backend == "nccl" and \
        nccl_env.get("NCCL_ALGO") else BACKEND_CHOICE
    env = environment(device)
    return {"schema": SCHEMA, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "world_size": world_size, "backend": request.backend,
            "device_type": device.type, "device_name": env["device_name"],
            "dtype": cfg.dtype, "algorithm": algorithm, "nccl_version": nccl,
            "nccl_env": nccl_env, "timing": "cuda events" if device.type == "cuda"
            else "perf_counter", "warmup": cfg.warmup, "iters": cfg.iters,
            "reps": cfg.reps, "env": env}


def _record(shared: dict, size_bytes: int, times_us: list[float], wrong: int,
            world_size: int) -> dict:
    time_us = statistics.median(times_us)
    algbw, busbw = bandwidths(size_bytes, time_us, world_size)
    stability = Stability(spread(times_us)).to_dict()
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    figures = {"size_bytes": size_bytes, "count": size_bytes // ELEMENT_BYTES[shared["dtype"]],
               "time_us": time_us, "times_us": times_us, "algbw_gbps": algbw,
               "busbw_gbps": busbw, "wrong": wrong, "time": now, "stability": stability}
    return {**{k: v for k, v in shared.items() if k != "env"}, **figures, "env": shared["env"]}




def main(argv: list[str] | None = None) -> None:
    """A worker: ``python -m kasoku.commands.allreduce_worker REQUEST_JSON`` under the launcher."""
    worker_main(worker, sys.argv[1:] if argv is None else argv,
                "usage: python -m kasoku.commands.allreduce_worker REQUEST_JSON (started by kasoku "
                "allreduce-bench, or torchrun)", parse=AllReduceRequest.from_json)


if __name__ == "__main__":
    main()
