"""``kasoku bench``: the argparse adapter of the sweep (the only place bench touches argparse).

    kasoku bench imagenet-resnet50 --batch-size 32,64,128,256 --ladder
    kasoku bench mnist-mlp --device cpu --config precision=bf16,compile=max-autotune
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kasoku.errors import ConfigError

GPU_DEFAULTS = {"steps": 20, "warmup": 5}
CPU_DEFAULTS = {"steps": 30, "warmup": 3}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return values


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers`` (``parser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "bench", help="the acceleration ladder: images/s per rung and batch size",
        description="Measure a workload's training throughput rung by rung (seed 004's "
        "ladder), each (rung, batch size) in a fresh process on synthetic batches already on "
        "the device (with --data, a last rung fed by a loader). Writes OUT/results.jsonl (one line per run) and OUT/ladder.png; exits "
        "non-zero when a rung breaks training (numerics guard) or a run crashes.")
    p.add_argument("workload", help="a name from `kasoku list`")
    p.add_argument("--batch-size", type=_int_list, metavar="N[,N...]",
                   help="batch sizes (default: the recipe's /8, /4, /2, x1 on a GPU; /8, /4 "
                   "on a CPU)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ladder", action="store_true",
                       help="the device's default ladder (the default): GPU plain, fp32, "
                       "tf32, amp, +channels_last, +fused, +compile, +cuda-graph, +fused-bn, "
                       "+fast-stem, +combo-kernels, +matmul-1x1, +wgrad-stream; CPU plain, "
                       "fp32, +fused, +bf16, +channels_last, +compile")
    which.add_argument("--config", action="append", metavar="SPEC",
                       help="a rung of your own, repeatable: a ladder label (amp, +compile) or "
                       "AccelConfig keys, e.g. precision=bf16,channels_last,compile=max-autotune"
                       " (plain is always measured too, and the fp32 reference of the "
                       "numerics guard runs for its losses)")
    p.add_argument("--data", type=Path, metavar="DIR",
                   help="the workload's dataset (the folder `kasoku train --data` reads): adds "
                   "a last rung, +loader, the rung before it fed by a loader from DIR instead "
                   "of synthetic batches on the device (seed 004's '+ the fastest loader')")
    p.add_argument("--loader", metavar="SPEC",
                   help="the +loader rung's loader, as `kasoku train --loader` takes it "
                   "(default: kasoku's pick: device for an in-memory dataset such as MNIST or "
                   "CIFAR-10, gpu-jpeg for a JPEG folder on a GPU, else multiprocess with one "
                   "worker per core)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--steps", type=int, help="steps per timed window (default: 20 GPU, 30 CPU)")
    p.add_argument("--windows", type=int, default=3, help="timed windows per run (default 3)")
    p.add_argument("--warmup", type=int,
                   help="warm-up steps after the numerics phase (default: 5 GPU, 3 CPU)")
    p.add_argument("--numerics-steps", type=int, default=10,
                   help="steps of the numerics guard, compared with fp32 (0: off; default 10)")
    p.add_argument("--out", type=Path,
                   help="folder for results.jsonl and ladder.png (default: "
                   "result/bench-WORKLOAD-DEVICE)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per run before it is stopped and recorded (default 900)")
    p.add_argument("--threads", type=int, help="CPU threads (default: the workload's, or one "
                   "per core)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    p.add_argument("--peak-size", type=int,
                   help="matrix size of the peak probe (default: 8192 GPU, 2048 CPU)")
    p.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                   help="after the windows, profile STEPS more steps and record where the "
                   "time goes by kind of kernel (GPU) or operator (CPU): convolutions and "
                   "matrix products, Triton (compiled code), optimizer, copies (default 0: off)")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: print the table and redraw ladder.png from "
                   "OUT/results.jsonl (the latest run of each rung and batch size), e.g. after "
                   "a ladder split over several commands")
    p.set_defaults(handler=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the sweep the arguments describe (or, with ``--report``, only redraw its table and
    chart). Returns the exit code: 0, or 1 when a rung breaks training or a run crashes or
    times out. Bad settings raise ``ConfigError``."""
    from kasoku.bench.sweep import run_sweep

    # --report measures nothing, so it may redraw a GPU sweep's results on any machine.
    device = _device(args.device, need_it=not args.report)
    out = args.out or Path("result") / f"bench-{args.workload}-{device.type}"
    if args.report:
        from kasoku.bench.report import report_results
        from kasoku.workloads import create_workload
        create_workload(args.workload)  # an unknown name is a ConfigError naming `kasoku list`
        try:
            chart = report_results(out, args.workload, device.type)
        except FileNotFoundError as exc:
            raise ConfigError(f"--report: {exc}; run the sweep first (without --report)")
        print(f"chart: {chart}" if chart else "nothing was measured: no chart")
        return 0
    return run_sweep(sweep_config(args, device, out)).exit_code


def sweep_config(args: argparse.Namespace, device, out: Path):
    """The ``SweepConfig`` of parsed arguments, with the device's defaults filled in."""
    from kasoku.bench.fed import check_data
    from kasoku.bench.rungs import PLAIN, default_ladder, rung_from_spec
    from kasoku.bench.sweep import SweepConfig
    from kasoku.workloads import create_workload

    wl = create_workload(args.workload)
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    rungs = default_ladder(device.type)
    if args.config:  # plain always: the speed-ups are over it
        rungs = [PLAIN]
        for spec in args.config:
            rung = rung_from_spec(spec, device.type)
            if rung.label not in [r.label for r in rungs]:
                rungs.append(rung)
    b = wl.recipe.batch_size
    default_sizes = [b // 8, b // 4, b // 2, b] if device.type == "cuda" else [b // 8, b // 4]
    batch_sizes = args.batch_size or sorted({max(1, s) for s in default_sizes})
    steps = args.steps if args.steps is not None else defaults["steps"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    for name, value, least in (("--steps", steps, 1), ("--windows", args.windows, 1),
                               ("--warmup", warmup, 0),
                               ("--numerics-steps", args.numerics_steps, 0),
                               ("--timeout", args.timeout, 1e-3), ("--threads", args.threads, 1),
                               ("--peak-size", args.peak_size, 1),
                               ("--kernels", args.kernels, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least:g}, got {value}")
    check_data(args.data, args.loader)
    if args.windows < 3:
        print(f"note: {args.windows} timed window(s): the median of fewer than 3 is not robust",
              file=sys.stderr)
    return SweepConfig(workload=args.workload, rungs=tuple(rungs),
                       batch_sizes=tuple(batch_sizes), out=out, device=str(device),
                       steps=steps, windows=args.windows, warmup=warmup,
                       numerics_steps=args.numerics_steps, timeout_s=args.timeout,
                       seed=args.seed, threads=args.threads, peak_size=args.peak_size,
                       kernels=args.kernels, data=args.data, loader=args.loader)


def _device(text: str | None, need_it: bool = True):
    import torch
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"kasoku bench runs on cpu or cuda, got {text!r}")
    if device.type == "cuda" and need_it:
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {text}: CUDA is not available in this PyTorch "
                              f"({torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {text}: this machine has "
                              f"{torch.cuda.device_count()} GPU(s)")
    return device
