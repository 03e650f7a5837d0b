"""``kasoku compare``: argv -> ``CompareConfig`` -> ``kasoku.commands.bench.compare.run_compare``
(the devices' ladders, their best rungs, the table and chart), or with ``--epochs`` ->
``kasoku.commands.bench.compare_train.train_on_devices`` (seed 001's time to accuracy).

    kasoku compare mnist-mlp,cifar10-lenet5 --devices cpu,cuda
    kasoku compare mnist-mlp --epochs 20 --data ~/data/mnist --devices cpu,cuda

The engines (and torch) are imported where the command runs: the parser loads no torch.
"""
from __future__ import annotations

from pathlib import Path

from kasoku.cli import args as a
from kasoku.cli.bench import _rung_spec
from kasoku.cli.train import add_data_arguments
from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.interrupts import stoppable
from kasoku.data.config import DataConfig
from kasoku.distributed import World, require_single_process
from kasoku.train.run_dir import out_or_new
from kasoku.workloads import create_workload


def _devices(text: str) -> list[str]:
    """``cpu,cuda``: devices as ``--device`` takes them, less auto, each type once."""
    items = [item.strip() for item in a.split_list(text, "cpu, cuda or cpu,cuda")]
    for item in items:
        if a.device(item) == "auto":
            a._fail("name the devices to compare: cpu, cuda or cuda:N (auto is one of them)")
    types = [item.partition(":")[0] for item in items]
    if len(set(types)) != len(types):
        a._fail(f"name each kind of device once, got {text!r}")
    return items


def _workloads(text: str) -> list[str]:
    return [item.strip() for item in a.split_list(text, "WORKLOAD[,WORKLOAD...]")]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="CPU against GPU, each at its best: the speed-up, each side's share "
        "of its own peak, and why",
        description="Run each device's acceleration ladder (as kasoku bench does, a fresh "
        "process per rung) and compare the devices' best rungs (the fastest whose numerics "
        "check passed): the GPU's speed-up over the CPU, each side's MFU against its own "
        "measured matmul peak, the ratio of the peaks and a one-line reading; epoch times "
        "extrapolated from the timed windows (a shorter window for long steps, said so). "
        "Appends OUT/results.jsonl (kasoku.compare/1), draws OUT/compare.png; each device's "
        "ladder is in OUT/bench-WORKLOAD-DEVICE. With --epochs: train the workload on each "
        "device instead and print the logs side by side with the total times.")
    p.add_argument("workloads", type=_workloads, metavar="WORKLOAD[,WORKLOAD...]",
                   help="names from `kasoku list` (or FILE.py:NAME), comma-separated")
    p.add_argument("--devices", type=_devices, metavar="cpu,cuda",
                   help="the devices to compare (default: cpu,cuda where CUDA is available, "
                   "else cpu)")
    p.add_argument("--batch-size", type=a.int_list, metavar="N[,N...]",
                   help="batch sizes to measure on every device, the best taken (default: the "
                   "recipe's, at most 100 on a CPU)")
    p.add_argument("--cpu-config", action="append", type=_rung_spec, metavar="SPEC",
                   help="a CPU rung instead of the whole CPU ladder, repeatable: a ladder "
                   "label (+fused, +bf16) or settings (precision=bf16,channels_last); plain "
                   "is measured too. With --epochs: the CPU run's levers (default +fused)")
    p.add_argument("--gpu-config", action="append", type=_rung_spec, metavar="SPEC",
                   help="a GPU rung instead of the whole GPU ladder, repeatable (+cuda-graph, "
                   "amp, ...); with --epochs: the GPU run's levers (default "
                   "precision=tf32,optimizer_impl=fused,cuda_graph, device loader)")
    p.add_argument("--steps", type=a.positive_int,
                   help="steps per timed window (default: 30 CPU, 20 GPU, fewer where a step "
                   "is long: the epoch time is extrapolated from them either way)")
    p.add_argument("--windows", type=a.positive_int, default=3,
                   help="timed windows per run; the median is reported (default 3)")
    p.add_argument("--warmup", type=a.nonnegative_int,
                   help="warm-up steps after the numerics phase (default: 3 CPU, 5 GPU, 1 for "
                   "a shortened window)")
    p.add_argument("--numerics-steps", type=a.nonnegative_int, default=10,
                   help="steps of the numerics guard, compared with fp32 (0: off; default 10)")
    p.add_argument("--threads", type=a.threads,
                   help="CPU threads (default: the workload's, or one per core)")
    p.add_argument("--peak-size", type=a.positive_int, metavar="N",
                   help="matrix size of the peak probes (default: 8192 GPU, 2048 CPU)")
    p.add_argument("--timeout", type=a.positive_float, default=900.0, metavar="SECONDS",
                   help="seconds per run before it is stopped and recorded (default 900)")
    p.add_argument("--seed", type=a.seed, default=0, help="seed for weights and batches")
    p.add_argument("--scale", type=Path, metavar="DIR",
                   help="a `kasoku scale --gpus 1,2` output folder (or its results.jsonl): "
                   "its 2-GPU rates fill a 2-GPU column")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for results.jsonl (appended), compare.png and each device's "
                   "ladder or run (default: a new folder runs/compare-WORKLOAD-DATE-TIME)")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: print the table and redraw compare.png from the "
                   "latest line of each workload in OUT/results.jsonl, e.g. after workloads "
                   "compared by several commands into one --out")
    form = p.add_argument_group("time to accuracy: the whole training on each device")
    form.add_argument("--epochs", type=a.positive_float,
                      help="train the workload for EPOCHS on each device with kasoku train's "
                      "trainer instead of measuring ladders, and print the logs side by side "
                      "with the total times")
    add_data_arguments(form)
    p.set_defaults(handler=run)


def resolve_devices(names: list[str] | None) -> tuple[str, ...]:
    """The devices asked for, each one this machine has (a missing CUDA is a ``ConfigError``
    saying what to do); by default cpu, and cuda where available."""
    import torch  # deferred: torch (module doc)

    from kasoku.commands.device import resolve_device  # deferred: torch (module doc)
    if names is None:
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    for name in names:
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--devices {','.join(names)}: this PyTorch sees no CUDA device "
                              f"(torch {torch.__version__}); compare on this machine with "
                              f"--devices cpu, or run the command on a machine with a GPU")
        resolve_device(name)  # a cuda:N beyond the devices here says so
    return tuple(names)


def run(args) -> int:
    """Measure (or train), report. Returns 0, or 1 when a run failed or a rung broke
    training; a request this machine cannot run raises ``ConfigError`` before any folder is
    made."""
    from kasoku.commands.bench.compare import (  # deferred: torch (module doc)
        CHART_FILE,
        RESULTS_FILE,
        CompareConfig,
        run_compare,
    )
    from kasoku.commands.bench.compare_report import plot_compare, print_compare  # deferred

    require_single_process(World.from_env(), "kasoku compare")
    workloads = [create_workload(w) for w in args.workloads]  # unknown: a ConfigError
    if args.report:
        return _report(args.out, [wl.name for wl in workloads], not args.no_chart)
    devices = resolve_devices(args.devices)
    specs = {"cpu": args.cpu_config, "cuda": args.gpu_config}
    if args.epochs is not None:
        return _time_to_accuracy(args, devices, workloads, specs)
    if args.root is not None or args.synthetic:
        warn_once("--data and --synthetic are read only with --epochs: the ladders run on "
                  "synthetic batches already on the device")
    name = workloads[0].name if len(workloads) == 1 else f"{len(workloads)}-workloads"
    out = out_or_new(args.out, name, "compare", "the results and the chart")
    cfg = CompareConfig(workloads=tuple(args.workloads), devices=devices, out=out,
                        batch_sizes=tuple(args.batch_size) if args.batch_size else None,
                        configs=specs, steps=args.steps, windows=args.windows,
                        warmup=args.warmup, numerics_steps=args.numerics_steps,
                        timeout_s=args.timeout, seed=args.seed, threads=args.threads,
                        peak_size=args.peak_size, scale=_scale_results(args.scale))
    with stoppable():  # SIGTERM too, and SIGINT when started ignored (kasoku.core.interrupts)
        lines, code = run_compare(cfg)
    print()
    print_compare(lines)
    chart = None if args.no_chart else plot_compare(lines, out / CHART_FILE)
    print(f"results: {out / RESULTS_FILE}" + (f", chart: {chart}" if chart else ""))
    return code


def _report(out: Path | None, names: list[str], chart: bool) -> int:
    from kasoku.commands.bench.compare import CHART_FILE, RESULTS_FILE  # deferred: torch
    from kasoku.commands.bench.compare_report import (  # deferred: torch (module doc)
        latest_lines,
        plot_compare,
        print_compare,
    )
    if out is None or not (out / RESULTS_FILE).is_file():
        raise ConfigError(f"--report redraws the results of earlier comparisons: give their "
                          f"--out folder (it holds {RESULTS_FILE})")
    lines = latest_lines(out, names)
    if not lines:
        raise ConfigError(f"--report: no comparison of {', '.join(names)} in "
                          f"{out / RESULTS_FILE}; run it first (without --report)")
    print_compare(lines)
    drawn = plot_compare(lines, out / CHART_FILE) if chart else None
    print(f"results: {out / RESULTS_FILE}" + (f", chart: {drawn}" if drawn else ""))
    return 0


def _scale_results(path: Path | None) -> Path | None:
    if path is None:
        return None
    file = path / "results.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--scale {path}: no kasoku scale results there; give the --out "
                          f"folder of `kasoku scale WORKLOAD --gpus 1,2` (or its results.jsonl)")
    return file


def _time_to_accuracy(args, devices, workloads, specs) -> int:
    from kasoku.commands.bench.compare_train import train_on_devices  # deferred: torch
    if len(workloads) != 1:
        raise ConfigError("--epochs trains one workload on each device; give one workload "
                          "(without --epochs, several are compared by their ladders)")
    for flag, given in (("--cpu-config", args.cpu_config), ("--gpu-config", args.gpu_config)):
        if given and len(given) > 1:
            raise ConfigError(f"{flag} is given {len(given)} times: with --epochs each device "
                              f"trains once, with one setting")
    data = a.config_from(args, DataConfig)
    out = out_or_new(args.out, workloads[0].name, "compare", "the runs and results")
    train_on_devices(args.workloads[0], devices, data, args.epochs, out,
                     {k: v[0] for k, v in specs.items() if v}, threads=args.threads,
                     seed=args.seed)
    print(f"results: {out / 'results.jsonl'}")
    return 0
