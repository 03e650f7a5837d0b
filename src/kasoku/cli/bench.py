"""``kasoku bench``: argv -> ``kasoku.commands.bench.sweep.SweepConfig`` -> ``run_sweep``.

    kasoku bench imagenet-resnet50 --batch-size 32,64,128,256 --ladder
    kasoku bench mnist-mlp --device cpu --config precision=bf16,compile=max-autotune

The engine is imported where the command runs, and the levers' combination checks where a
well-formed ``--config`` is checked: the parser loads no torch, nor does a mistake in a
``--config``'s keys or values.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from kasoku.cli import args as a
from kasoku.cli.train import WORKLOAD_HELP, add_workload_settings, workload_spec
from kasoku.commands.bench.rung_spec import LADDER_LABELS, SHORT_CPU_LADDER, parse_spec
from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.core.interrupts import stoppable
from kasoku.distributed import World, require_single_process
from kasoku.train.run_dir import OUTPUT_ROOT
from kasoku.workloads import create_workload
from kasoku.workloads.registry import CPU_MAX_BATCH, default_batch_sizes, split_settings


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="the acceleration ladder: training throughput rung by rung",
        description="Measure a workload's training throughput rung by rung, each rung adding "
        "one lever (the acceleration ladder), each (rung, batch size) in a fresh process on "
        "synthetic batches already on the device (with --data, a last rung fed by a loader). "
        "Appends OUT/results.jsonl (one line per run), draws OUT/ladder.png and ends with one "
        "line of conclusion: the rung that wins over plain, by how much, inside or outside the "
        "noise; exits 1 when a rung breaks training (numerics guard) or a run crashes. "
        "SIGINT (Ctrl-C, also when started in the background with it ignored) or SIGTERM "
        "stops it with its runs' processes, keeps the runs finished and names the commands "
        "that measure the rest (exit 130 or 143).")
    p.add_argument("workload", help=WORKLOAD_HELP)
    p.add_argument("--device", type=a.device, default="auto",
                   metavar="{auto,cpu,cuda,cuda:N}",
                   help="where to measure: auto (cuda when available, else cpu), cpu, cuda "
                   "or cuda:N (default: auto)")
    p.add_argument("--batch-size", type=a.int_list, metavar="N[,N...]",
                   help="batch sizes (default: the recipe's /8, /4, /2, x1 on a GPU; on a "
                   f"CPU the recipe's, at most {CPU_MAX_BATCH}, with {flag('bench.full')} "
                   "also its /8 and /4)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ladder", action="store_true",
                       help="the device's default ladder (the default): GPU plain, fp32, "
                       "tf32, amp, +channels_last, +fused, +compile, +cuda-graph, +fused-bn, "
                       "+fast-stem, +combo-kernels, +matmul-1x1, +wgrad-stream (a "
                       "transformer, gpt: plain, fp32, tf32, amp, +fused, +compile, "
                       f"+cuda-graph, +float8); CPU {', '.join(SHORT_CPU_LADDER)} (about a "
                       f"minute on 2 quiet cores; {flag('bench.full')}: the whole CPU ladder)")
    which.add_argument(flag("bench.full"), action="store_true",
                       help="on a CPU, the whole ladder and batch sweep: plain, fp32, +fused, "
                       "+keep-memory, +bf16 (skipped without bf16 hardware), +channels_last, "
                       "+compile at the recipe's batch /8, /4 and x1 (at most "
                       f"{CPU_MAX_BATCH}); several minutes on 2 cores. A GPU's ladder is "
                       "always whole")
    which.add_argument("--config", action="append", metavar="SPEC", type=_rung_spec,
                       help="a rung of your own, repeatable: a ladder label (amp, +compile) or "
                       "lever settings as `kasoku train` names them, e.g. "
                       "precision=bf16,channels_last,compile=max-autotune (plain is always "
                       "measured too, and the fp32 reference of the numerics guard runs for "
                       "its losses)")
    p.add_argument("--data", type=Path, metavar="DIR",
                   help="the workload's dataset (the folder `kasoku train --data` reads): adds "
                   "a last rung, +loader, the rung before it fed by a loader from DIR instead "
                   "of synthetic batches on the device")
    p.add_argument("--loader", type=a.loader_spec, metavar="KIND[:N]",
                   help="the +loader rung's loader, as `kasoku train --loader` takes it "
                   "(default: kasoku's pick: device for an in-memory dataset such as MNIST or "
                   "CIFAR-10, gpu-jpeg for a JPEG folder on a GPU, else multiprocess with one "
                   "worker per core)")
    p.add_argument("--no-loader-cores", dest="loader_cores", action="store_false",
                   help="on a CPU, leave the +loader rung's worker processes or threads on the "
                   "cores of PyTorch's threads (by default each side is pinned to cores of its "
                   "own, as in kasoku train)")
    p.add_argument("--steps", type=a.positive_int,
                   help="steps per timed window (default: 20 GPU, 30 CPU)")
    p.add_argument("--windows", type=a.positive_int, default=3,
                   help="timed windows per run; the median is reported (default 3; a run "
                   "whose windows disagree takes up to twice as many again, so the title says "
                   "the range measured)")
    p.add_argument("--warmup", type=a.nonnegative_int,
                   help="warm-up steps after the numerics phase (default: 5 GPU, 3 CPU)")
    p.add_argument("--numerics-steps", type=a.nonnegative_int, default=10,
                   help="steps of the numerics guard, compared with fp32 (0: off; default 10)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for results.jsonl and ladder.png; results are appended, never "
                   "replaced (default: runs/bench-WORKLOAD-DEVICE)")
    p.add_argument("--timeout", type=a.positive_float, default=900.0, metavar="SECONDS",
                   help="seconds per run before it is stopped and recorded (default 900)")
    p.add_argument("--threads", type=a.threads,
                   help="CPU threads (default: the workload's, or one per core)")
    p.add_argument("--seed", type=a.seed, default=0, help="seed for weights and batches")
    p.add_argument("--peak-size", type=a.positive_int, metavar="N",
                   help="matrix size of the peak probe (default: 8192 GPU, 2048 CPU)")
    p.add_argument("--kernels", type=a.nonnegative_int, default=0, metavar="STEPS",
                   help="after the windows, profile STEPS more steps and record where the "
                   "time goes by kind of kernel (GPU) or operator (CPU): convolutions and "
                   "matrix products, Triton (compiled code), optimizer, copies (default 0: off)")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: print the table and redraw ladder.png from "
                   "OUT/results.jsonl (the latest run of each rung and batch size), e.g. after "
                   "a ladder split over several commands")
    add_workload_settings(p)
    for name in ("--gpus", "--procs"):  # said plainly rather than "unrecognized arguments"
        p.add_argument(name, type=_to_scale, help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


def _to_scale(text: str):
    a._fail("kasoku bench measures one process per rung; to measure a rung on several "
            "workers use kasoku scale WORKLOAD --gpus N[,N...] (or --procs) --config RUNG")


def _rung_spec(text: str) -> str:
    """A ``--config`` value, checked where it is parsed: a rung label of any ladder, or lever
    settings ``parse_config`` takes (the device's ladder resolves labels later). Its keys and
    values are read without torch; only well-formed settings load it, to refuse what cannot be
    combined (``check_config``)."""
    spec = text.strip()
    if spec in LADDER_LABELS:
        return spec
    try:
        config = parse_spec(spec)
        from kasoku.accel.compose import check_config  # deferred: torch, only for a --config
        check_config(config)
    except ConfigError as exc:
        a._fail(str(exc))
    return spec


def default_out(workload_name: str, device_type: str) -> Path:
    return OUTPUT_ROOT / f"bench-{workload_name}-{device_type}"


def run(args) -> int:
    """Run the sweep the arguments describe (or, with ``--report``, only redraw its table and
    chart). Returns the exit code: 0, or 1 when a rung breaks training or a run crashes or
    times out. Bad settings raise ``ConfigError``."""
    from kasoku.commands.bench.report import report_results  # deferred: torch (module doc)
    from kasoku.commands.device import resolve_device  # deferred: torch (module doc)

    require_single_process(World.from_env(), "kasoku bench")
    # --report measures nothing, so it may redraw a GPU sweep's results on any machine.
    device = resolve_device(args.device, need_it=not args.report)
    spec = workload_spec(args)
    wl = create_workload(spec)  # an unknown name is a ConfigError naming `kasoku list`
    # A workload's settings name its folder too: bench-gpt-small-plain-cpu.
    out = args.out or default_out("-".join([wl.name, *split_settings(spec)[1].values()]),
                                  device.type)
    if args.report:
        try:
            chart = report_results(out, spec, device.type)
        except FileNotFoundError:
            raise ConfigError(f"--report: no results.jsonl in {out}; run the sweep first "
                              f"(without --report), or give its --out") from None
        print(f"chart: {chart}" if chart else "nothing was measured: no chart")
        return 0
    from kasoku.commands.bench.sweep import run_sweep  # deferred: torch (module doc)
    cfg = sweep_config(args, wl, device, out)
    with stoppable():  # SIGTERM too, and SIGINT when started ignored (kasoku.core.interrupts)
        return run_sweep(cfg).exit_code


def sweep_config(args, wl, device, out: Path):
    """The ``SweepConfig`` of parsed arguments, with the device's defaults filled in."""
    from kasoku.commands.bench.fed import check_data  # deferred: torch (module doc)
    from kasoku.commands.bench.rungs import ladder_or_specs  # deferred: torch (module doc)
    from kasoku.commands.bench.sweep import WINDOW_DEFAULTS, SweepConfig  # deferred: torch

    defaults = WINDOW_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    rungs = ladder_or_specs(device.type, args.config, wl.ladder, full=args.full)
    batch_sizes = args.batch_size or list(default_batch_sizes(wl.recipe.batch_size, "bench",
                                                              device.type, full=args.full))
    check_data(args.data, args.loader)
    if args.windows < 3:
        warn_once(f"--windows {args.windows}: the median of fewer than 3 timed windows is not "
                  f"robust")
    return SweepConfig(workload=workload_spec(args), rungs=tuple(rungs),
                       batch_sizes=tuple(batch_sizes), out=out, device=str(device),
                       steps=args.steps or defaults["steps"], windows=args.windows,
                       warmup=args.warmup if args.warmup is not None else defaults["warmup"],
                       numerics_steps=args.numerics_steps, timeout_s=args.timeout,
                       seed=args.seed, threads=args.threads, peak_size=args.peak_size,
                       kernels=args.kernels, data=args.data, loader=args.loader,
                       loader_cores=args.loader_cores, more=_more(args, device.type),
                       argv=tuple(getattr(args, "argv", ())))


def _more(args, device_type: str) -> str | None:
    """What the closing line of the short CPU ladder says to run for the rest of it."""
    if device_type == "cuda" or args.full or args.config:
        return None
    sizes = " and the recipe's batch /8 and /4" * (not args.batch_size)
    return (f"for the whole CPU ladder run again with {flag('bench.full')} (+keep-memory, "
            f"+bf16, +channels_last, +compile{sizes}: several minutes)")
