"""``kasoku allreduce-bench``: argv -> ``AllReduceConfig`` and the world sizes ->
``kasoku.commands.allreduce_bench.run_allreduce_bench``; prints the table, writes the chart.

    kasoku allreduce-bench --gpus 1,2,4,8 --dtype bf16
    kasoku allreduce-bench --procs 1,2 --sizes 4K,1M,16M
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from kasoku.cli import args as a
from kasoku.commands.allreduce_bench import (
    CHART_FILE,
    DEFAULT_MAX_SIZE,
    DTYPES,
    RESULTS_FILE,
    AllReduceConfig,
    BenchFailed,
    check_sizes,
    default_sizes,
    parse_size,
    plot_busbw,
    print_results,
    run_allreduce_bench,
)
from kasoku.core.errors import ConfigError
from kasoku.distributed import World, require_single_process
from kasoku.distributed.plan import plan_worlds
from kasoku.train.run_dir import out_or_new


def size(text: str) -> int:
    """A message size: ``N``, ``NK``, ``NM`` or ``NG`` bytes (powers of 1024)."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        a._fail(str(exc))


def size_list(text: str) -> list[int]:
    """``4K,1M,64M``: sizes as ``size`` takes them, comma-separated."""
    return [size(item) for item in a.split_list(text, "SIZE or SIZE,SIZE,... (e.g. 4K,1M,64M)")]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "allreduce-bench", help="all-reduce bandwidth of torch.distributed (NCCL on GPUs, "
        "gloo on the CPU), as nccl-tests reports it",
        description="Measure torch.distributed.all_reduce at each message size in N processes "
        "started by PyTorch's elastic launcher (torchrun's), once per world size: time, algbw "
        "= bytes / time and busbw = algbw x 2(n-1)/n (GB/s, nccl-tests' definitions). Prints "
        "a table, appends OUT/results.jsonl and draws OUT/busbw.png. NCCL's algorithm is its "
        "own choice unless NCCL_ALGO is set; NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING "
        "prints what it picked. Exits 1 when a worker fails or a sum comes back wrong.")
    world = p.add_mutually_exclusive_group()
    world.add_argument("--gpus", type=a.int_list, metavar="N[,N...]",
                       help="world sizes on GPUs, a process per GPU over NCCL, each measured "
                       "in its own launch (default with CUDA: all visible GPUs)")
    world.add_argument("--procs", type=a.int_list, metavar="N[,N...]",
                       help="world sizes of CPU processes over gloo, each measured in its own "
                       "launch (default without CUDA: 2)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sizes", type=size_list, metavar="SIZE[,SIZE...]",
                       help="message sizes in bytes, K/M/G as powers of 1024, e.g. 4K,1M,64M "
                       "(default: 4K to --max-size in x4 steps)")
    which.add_argument("--max-size", type=size, metavar="SIZE",
                       help="the largest size of the default 4K, 16K, 64K, ... ladder "
                       "(default: 256M on GPUs, 64M on the CPU)")
    a.add_fields(p, AllReduceConfig, {
        "dtype": {"type": a.choice(DTYPES), "metavar": "{" + ",".join(DTYPES) + "}"},
        "warmup": {"type": a.nonnegative_int, "metavar": "N"},
        "iters": {"metavar": "N"},
        "reps": {"metavar": "N"},
        "timeout_s": {"flag": "--timeout", "metavar": "SECONDS"}})
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for results.jsonl (appended) and busbw.png (default: a new "
                   "folder runs/allreduce-bench-BACKEND-DATE-TIME)")
    p.add_argument("--no-chart", action="store_true", help="do not draw busbw.png")
    p.set_defaults(handler=run)


def run(args) -> int:
    """Plan, measure, report. Returns 0, or 1 when a worker failed or a sum was wrong; a
    request this machine cannot run raises ``ConfigError`` before any folder is made."""

    # It launches its own processes: started as one of several, each would launch a set.
    require_single_process(World.from_env(), "kasoku allreduce-bench")
    plan = plan_worlds(gpus=args.gpus, procs=args.procs)
    cfg = a.config_from(args, AllReduceConfig, sizes=args.sizes or default_sizes(
        args.max_size or DEFAULT_MAX_SIZE[plan.device_type]))
    cfg = dataclasses.replace(cfg, sizes=check_sizes(cfg.sizes, cfg.dtype))
    out = out_or_new(args.out, plan.backend, "allreduce-bench", "the results and the chart")
    if plan.note:
        print(f"# default: {plan.note}", flush=True)
    try:
        records = run_allreduce_bench(cfg, plan, out)
    except BenchFailed as exc:
        print(f"kasoku: error: {exc}", file=sys.stderr, flush=True)
        if (out / RESULTS_FILE).is_file():
            print(f"results of the sizes measured before: {out / RESULTS_FILE}", flush=True)
        return 1
    print_results(records)
    if not args.no_chart:
        print(f"chart: {plot_busbw(records, out / CHART_FILE)}")
    print(f"results: {out / RESULTS_FILE}")
    wrong = [r for r in records if r["wrong"]]
    if wrong:
        r = wrong[0]
        print(f"kasoku: error: all-reduce of {r['size_bytes']} bytes among {r['world_size']} "
              f"processes returned {r['wrong']} wrong elements; the backend or the "
              f"interconnect is broken: rerun with NCCL_DEBUG=WARN to see why",
              file=sys.stderr, flush=True)
        return 1
    return 0
