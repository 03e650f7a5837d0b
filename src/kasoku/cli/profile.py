"""``kasoku profile``: argv -> the ``kasoku train`` configs, resolved into one
``kasoku.run.RunConfig``, plus ``ProfileConfig`` -> ``kasoku.commands.profile.profile_run``
(with ``--procs N``/``--gpus N``, in each worker, given their JSON:
``kasoku.cli.profile_worker``); prints the figures and the verdict. With ``--``,
what follows is a training script's command (``kasoku profile --skip 5 -- python train.py
ARGS``) -> ``kasoku.commands.script_profile.profile_script``. The engines are imported where
the command runs: the parser loads no torch."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kasoku.cli import args as a
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.cli.distributed import DIST_FLAGS, dist_config_from_args
from kasoku.cli.train import (
    KFAC_FLAGS,
    LOADER_CORES_FLAG,
    TRAIN_FLAGS,
    WORKLOAD_HELP,
    add_data_arguments,
    add_workload_settings,
    kfac_config_from_args,
    workload_spec,
)
from kasoku.commands.profile_config import ProfileConfig, ProfileRequest
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.distributed import World
from kasoku.distributed.config import DistConfig
from kasoku.distributed.launch import launch, under_launcher
from kasoku.kfac.config import KFACConfig
from kasoku.run import RunConfig, resolve
from kasoku.train.config import TrainConfig
from kasoku.train.run_dir import out_or_new, refuse_a_run
from kasoku.workloads import create_workload

PROFILE_FLAGS = {"steps": {"type": a.positive_int, "metavar": "N"},
                 "warmup": {"type": a.nonnegative_int, "metavar": "N"},
                 "skip": {"type": a.nonnegative_int, "metavar": "N"},
                 "measure_steps": {"type": a.positive_int, "metavar": "N"},
                 "measure_seconds": {"type": a.positive_float, "metavar": "S"},
                 "confirm": None, "estimate": None,
                 "rounds": {"type": a.positive_int, "metavar": "N"}, "python": None,
                 "stop_after_window": None}
PROFILE_DIST = ("gpus", "procs", "dist_timeout", "bucket_mb", "static_graph", "shard",
                "allreduce_dtype", "sync_bn")
"""The data-parallel options a profile takes (one machine; no restarts)."""
_RUN_FLAGS = {k: v for k, v in TRAIN_FLAGS.items()
              if k in ("device", "batch_size", "lr", "grad_clip", "optimizer", "seed", "threads")}
SCRIPT_FLAGS = ("--skip", "--warmup", "--steps", "--measure-steps", "--out",
                "--stop-after-window", "--with", "--estimate", "--confirm", "--rounds",
                "--measure-seconds", "--measure-only")
"""The options a script's profile takes."""
TRAINING_LEVERS = ("workers=N (every DataLoader with num_workers=N), pin-memory (every "
                   "DataLoader with pin_memory=True), threads=N, interop-threads=N, tf32, "
                   "cudnn-benchmark, bf16 (the script under torch.autocast bf16), "
                   "fused-optimizer (Adam, AdamW, SGD made with fused=True, else "
                   "foreach=True), channels-last (the model's convolutions and inputs), "
                   "compile[=MODE] (the model compiled in place before its first call), "
                   "persistent-workers, prefetch=N (every DataLoader with worker processes "
                   "made with persistent_workers=True, prefetch_factor=N), "
                   "allocator[=jemalloc|tcmalloc] (a malloc found on this machine in "
                   "LD_PRELOAD), expandable-segments (CUDA's allocator)")
"""The ``--with`` levers a script can train with (``kasoku run``'s; a profile adds replay)."""


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="where each step's time goes, the bottleneck and the "
                       "next lever (--confirm proves it)",
                       description="Profile a short window of a workload's training steps "
                       "(the options of kasoku train choose the run) and say which bottleneck "
                       "it is and what to do next. Writes trace.json (Perfetto, "
                       "chrome://tracing), profile.json, timeline.png and report.html to a new "
                       "folder under runs/ (or --out DIR). Your own training script, "
                       "unchanged: kasoku profile [--skip N --warmup N --steps N --out DIR "
                       "--stop-after-window --with LEVER] -- python train.py ARGS (or -- "
                       "python -m MODULE ARGS); the levers kasoku can set from outside the "
                       "script are measured in fresh runs of it, the others said as the edit "
                       "to make.")
    p.add_argument("workload", nargs="?",
                   help=WORKLOAD_HELP + "; or none, and a script's command after --")
    a.add_fields(p, TrainConfig, _RUN_FLAGS)
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for the trace and the report (default: a new folder "
                   "runs/profile-WORKLOAD-DATE-TIME)")
    add_data_arguments(p.add_argument_group("data"))
    a.add_fields(p.add_argument_group("loader"), TrainConfig, {
        "loader": {"type": a.loader_spec, "metavar": "KIND[:N]",
                   "help": "which loader makes the batches (see kasoku train --help)"},
        "prefetch": {"metavar": "N"}, "loader_cores": LOADER_CORES_FLAG})
    a.add_fields(p.add_argument_group("K-FAC (--optimizer kfac)"), KFACConfig, KFAC_FLAGS)
    add_accel_arguments(p)
    a.add_fields(p.add_argument_group("profile"), ProfileConfig, PROFILE_FLAGS)
    group = p.add_argument_group(
        "data-parallel", "profile worker 0 of N workers (PyTorch's DistributedDataParallel) "
        "as kasoku train --gpus/--procs runs them; --batch-size is per worker")
    a.add_fields(group, DistConfig, {k: v for k, v in DIST_FLAGS.items() if k in PROFILE_DIST})
    p.add_argument("--with", dest="with_levers", action="append", metavar="LEVER",
                   help="a script's profile only: run the script with a lever kasoku sets "
                   "from outside it (repeat for several): replay (the DataLoader's first "
                   "batches again and again: no wait for data), " + TRAINING_LEVERS)
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    add_workload_settings(p)
    p.set_defaults(handler=run, script=None)


def split_script(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``kasoku profile OPTIONS -- COMMAND`` (or ``kasoku run``): (kasoku's arguments, the
    script's command); None for the command when there is no ``--`` (or another command)."""
    if argv[:1] not in (["profile"], ["run"]) or "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def run(args) -> int:
    if args.out is not None and not args.measure_only and not under_launcher():
        refuse_a_run(args.out, "the profile")
    if args.script is not None or args.workload is None:
        return run_script(args)
    for flag, given in (("--stop-after-window", args.stop_after_window),
                        ("--with", args.with_levers)):
        if given:
            raise ConfigError(f"{flag} is for a script: kasoku profile {flag} ... -- python "
                              f"train.py")
    data = a.config_from(args, DataConfig)
    train = a.config_from(args, TrainConfig, **a.synthetic_loader(args, data))
    train.progress = False
    cfg = a.config_from(args, ProfileConfig)
    dist = dist_config_from_args(args)
    run_cfg = resolve(create_workload(workload_spec(args)), data, train,
                      accel_config_from_args(args), dist, kfac_config_from_args(args))
    if dist.asked and not under_launcher():
        return _launch(args, dist, cfg, run_cfg)
    return profile_here(run_cfg, cfg, args.out, args.measure_only, args.argv)


def profile_here(run_cfg: RunConfig, cfg: ProfileConfig, out: Path | None,
                 measure_only: bool, argv: list[str] | None = None) -> int:
    """Profile ``run_cfg`` in this process (alone, or as one worker of a data-parallel run:
    ``kasoku.cli.profile_worker``) and print its figures and verdict, or with
    ``measure_only`` its result as one JSON line; ``argv``: the command line, for
    ``--confirm`` to vary."""
    from kasoku.commands.profile import profile_run  # deferred: torch (module doc)
    result = profile_run(run_cfg, cfg, out=out, measure_only=measure_only, argv=argv)
    if run_cfg.dist.asked and not World.from_env().is_main:
        return 0  # worker 0 speaks for all
    if measure_only:
        print(json.dumps(result, default=str))
        return 0
    print(summary(result))
    return 0


def run_script(args) -> int:
    """A script's profile: exactly one of a workload or a script, and only the options that
    apply to a script (a one-line ``ConfigError`` otherwise)."""
    if args.workload is not None:
        raise ConfigError(f"give a workload or a script after --, not both (got "
                          f"{args.workload!r} and {' '.join(args.script)!r})")
    if args.script is None:
        raise ConfigError("give a workload (kasoku list names them) or a script's command "
                          "after --: kasoku profile -- python train.py")
    for word in args.argv[1:]:
        flag = word.split("=", 1)[0]
        if flag == "--device":
            raise ConfigError("--device is not for a script: its profile follows the device "
                              "the script trains on")
        if flag.startswith("--") and flag not in SCRIPT_FLAGS:
            raise ConfigError(f"{flag} is not yet for a script (a script's profile takes "
                              f"{', '.join(SCRIPT_FLAGS[:-1])})")
    from kasoku.commands.ab import without_own  # deferred: torch (module doc)
    from kasoku.commands.script_launch import parse_launched, profile_launched  # deferred
    from kasoku.commands.script_profile import profile_script, say, verdict_lines  # deferred
    from kasoku.commands.script_run import parse_command  # deferred: torch (module doc)
    cfg = a.config_from(args, ProfileConfig)
    launched = parse_launched(args.script)
    if launched is not None:
        if args.measure_only or under_launcher():
            raise ConfigError("torchrun inside torchrun: give the script's command after --")
        code, result = profile_launched(launched, cfg, args.out, args.with_levers,
                                        without_own(args.argv[1:]), say)
        for line in verdict_lines(result) if result else ():
            say(line)
        return code
    return profile_script(parse_command(args.script), cfg, out=args.out,
                          given=args.with_levers, measure_only=args.measure_only)


def _launch(args, dist, cfg, run_cfg) -> int:
    """Start the workers (each given the run and the profile's settings as JSON:
    ``kasoku.cli.profile_worker``), then, with ``--confirm``, run the A/B from here: each side
    launches its own workers."""
    from kasoku.commands.ab import ladder_lines, tried_lines  # deferred: torch (module doc)
    from kasoku.commands.profile import ab_saved  # deferred: torch (module doc)
    run_cfg.check()  # a mistake is said once, not by each worker
    wl = create_workload(run_cfg.workload)
    if args.measure_only:
        return _launch_workers(ProfileRequest(run_cfg, cfg, args.out, measure_only=True), dist)
    out = out_or_new(args.out, wl.name, "profile", "the profile")
    code = _launch_workers(ProfileRequest(run_cfg, cfg, out), dist)
    if code or (cfg.estimate and not cfg.confirm):
        return code
    result = ab_saved(out, list(args.argv), cfg)
    print("\n".join([f"verdict (the levers measured): {result['verdict'].line}",
                      *tried_lines(result["verdict"]),
                      *ladder_lines(result.get("ladder")), f"report: {result.get('report')}"]))
    return 0


def _launch_workers(request: ProfileRequest, dist: DistConfig) -> int:
    return launch([request.to_json()], dist, module="kasoku.cli.profile_worker")


def summary(result: dict) -> str:
    """The figures, the verdict (a ``Verdict``) and the ladder as a few lines of text."""
    from kasoku.commands.ab import ladder_lines, tried_lines  # deferred: torch (module doc)
    from kasoku.core.phases import format_phases  # deferred: torch (module doc)
    from kasoku.perf.profile.figures import profiler_cost  # deferred: torch (module doc)
    from kasoku.perf.profile.kfac_cost import format_kfac  # deferred: torch (module doc)
    from kasoku.perf.profile.roofline import format_table  # deferred: torch (module doc)
    f, v = result["figures"], result["verdict"]
    lines = [f"phases (unprofiled): {format_phases(result['phases'])}"]
    cost = profiler_cost(f, result.get("window_rates"), result.get("samples_per_step"))
    if cost:
        lines.append(f"profiled window: {cost}")
    if f.get("kfac"):
        lines.append(format_kfac(f["kfac"]))
    if "busy_pct" in f:
        lines.append(
            f"device: busy {f['busy_pct']:.0f}% | idle: data {f['idle_data_pct']:.0f}%, "
            f"host launch {f['idle_host_pct']:.0f}%, other {f['idle_other_pct']:.0f}% | "
            f"{f['kernels_per_step']:.0f} kernels, {f['launches_per_step']:.0f} launches per "
            f"step | host {f['host_ms']:.2f} ms vs device {f['device_ms']:.2f} ms per step")
    else:
        lines.append(f"cpu: {f['operator_pct']:.0f}% of the step in operators, "
                     f"{f['ops_per_step']:.0f} operators per step")
    kind = ", ".join(f"{k} {ms:.2f}" for k, ms in f["by_kind_ms"].items() if ms > 0)
    if "busy_pct" in f:
        lines.append(f"time by kind (GPU kernels, ms per profiled step): {kind}")
    else:  # the operators' self time on every thread, and the rest of the profiled step
        rest = (f.get("profiled") or {}).get("step_ms", f["step_ms"]) - sum(
            f["by_kind_ms"].values())
        lines.append(f"time by kind (the operators' own time, ms per profiled step): {kind}; "
                     f"outside operators {max(rest, 0.0):.2f} (Python, dispatch, the loader)")
    if f.get("roofline"):
        lines += format_table(f["roofline"], f["step_ms"])
    elif f.get("by_class_ms"):
        classes = ", ".join(f"{k} {ms:.2f}" for k, ms in f["by_class_ms"].items() if ms > 0)
        lines.append(f"time by kernel class (ms/step): {classes}")
    if f.get("mfu") is not None:
        lines.append(f"MFU: {100 * f['mfu']:.1f}% ({f['mfu_note']})")
    elif f.get("peak_fraction") is not None:
        line = (f"CPU {f.get('peak_dtype', 'fp32')} peak: {100 * f['peak_fraction']:.1f}% of "
                f"the measured {f['peak_flops_per_s'] / 1e12:.2f} TFLOP/s"
                + ("" if f.get("peak_stable", True) else " (unstable: rough)"))
        if f.get("peak_theory"):
            share = f["peak_flops_per_s"] / f["peak_theory"]["flops_per_s"]
            line += (f"; first principles {f['peak_theory_text']}, the measured peak "
                     f"{100 * share:.0f}% of it")
        lines.append(line)
    if f.get("mem_peak_gib") is not None:
        lines.append(f"peak memory: {f['mem_peak_gib']:.2f} GiB; recompilations in the "
                     f"window: {f['recompiles']}")
    lines.append(f"verdict: {v.line}")
    if not (result.get("stability") or {}).get("stable", True):
        lines.append("  unstable: the verdict rests on timed steps that were unstable (the "
                     "unstable: lines above): its figures and advice are estimates; measure "
                     "again on a quiet machine")
    lines += tried_lines(v)
    if v.lever.caveat:
        lines.append(f"  note: {v.lever.caveat}")
    for also in v.secondary:
        lines.append(f"  also: {also}")
    lines += ladder_lines(result.get("ladder"))
    if result.get("python_profile"):
        lines.append(f"host Python profile (pyinstrument): {result['python_profile']}")
    lines.append(f"report: {result.get('report')}  trace: {result['out']}/trace.json")
    return "\n".join(lines)
