"""``kasoku profile``: build the run as ``kasoku train`` would, time it unprofiled, profile a
short window, judge it, draw it, and (``confirm``) prove the verdict with an A/B of fresh
processes.

Steps of one profile, on the trainer's own updater (the extensions -- log, snapshots,
evaluation -- do not run):
1. ``skip`` steps absorb compilation, graph capture and autotuning (timed, reported);
2. ``measure_steps`` steps timed as a whole (CUDA events and one synchronize) with the phase
   clock on: the throughput and phases without the profiler; with K-FAC, whole cycles of its
   factor and inverse steps, every step timed (``kasoku.perf.profile.kfac_cost``);
3. the profiled window (``kasoku.perf.profile.window``): ``warmup`` + ``steps`` steps;
4. the analysis, MFU against the measured matmul peak, the verdict; ``profile.json``,
   ``trace.json``, ``timeline.png``, ``report.html`` in ``out``.
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from kasoku.accel.checkpointing import checkpointable_blocks
from kasoku.accel.graph import eagerly
from kasoku.advisor.advice import advise
from kasoku.advisor.script import ScriptVerdict
from kasoku.advisor.verdict import Verdict, judge
from kasoku.commands import ab
from kasoku.commands.bench.pool import batch_spec
from kasoku.commands.bench.rungs import Rung, compute_dtype
from kasoku.commands.device import resolve_device
from kasoku.commands.job import join_as_worker, leave_job
from kasoku.commands.profile_config import ProfileConfig
from kasoku.commands.profile_steps import sync, time_steps
from kasoku.commands.train import build_run, close_run
from kasoku.core.errors import ConfigError
from kasoku.core.flags import option
from kasoku.core.phases import format_phases
from kasoku.data.registry import dataset_kind
from kasoku.distributed import World, fsdp, require_single_process
from kasoku.distributed.launch import under_launcher
from kasoku.kfac import KFAC
from kasoku.perf import cpuinfo
from kasoku.perf.mfu import compute_mfu
from kasoku.perf.peak import measure_matmul_peak
from kasoku.perf.profile import trace as trace_mod
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.profile.html import write_report
from kasoku.perf.profile.kfac_cost import (
    kfac_figures,
)
from kasoku.perf.profile.roofline import draw as draw_roofline
from kasoku.perf.profile.timeline import draw_timeline
from kasoku.perf.profile.window import machine_facts, profile_updater
from kasoku.perf.profile.work import optimizer_bytes
from kasoku.run import RunConfig
from kasoku.train.run_dir import make_out_dir, out_or_new
from kasoku.workloads import create_workload


def profile_run(run: RunConfig, cfg: ProfileConfig, out: Path | None = None,
                measure_only: bool = False, argv: list[str] | None = None) -> dict:
    """Profile ``run``; returns the result written to ``out/profile.json`` (its verdict a
    ``Verdict``: ``write_outputs`` writes its ``to_dict``).
    ``measure_only``: steps 1 and 2 only, the result printed as one JSON line (a side of
    ``confirm``). ``argv``: the command line, for ``confirm`` to vary.

    ``run.dist`` asking for workers, in a process the launcher started: this process is one
    worker of a data-parallel run, every worker steps and is profiled in lockstep, and worker
    0 judges, writes and prints (the other workers' traces go to ``out/workerR``);
    ``confirm`` is left to the launching process."""
    world = World.from_env()
    parallel = run.dist.asked
    if not parallel:
        require_single_process(world, "kasoku profile")
    run.check()
    if cfg.python:
        _require_pyinstrument()
    workload = create_workload(run.workload)
    # a side's other workers keep nothing: no folder of theirs in the person's runs/
    scratch = Path(tempfile.mkdtemp(prefix="kasoku-side-")) \
        if parallel and measure_only and not world.is_main and out is None else None
    out = scratch or out_or_new(out, workload.name, "profile", "the profile")
    if parallel:
        run = replace(run, train=join_as_worker(world, run.train, run.dist,
                                                resolve_device(run.train.device)))
        if not world.is_main:
            out = make_out_dir(out / f"worker{world.rank}", "a worker's trace")
    speak = world.is_main or not parallel
    trainer = None
    try:
        trainer = build_run(run, workload, out=out, world=world if parallel else None,
                            parallel=parallel)
        result = _profile(workload, trainer, run.data, run.train, run.accel, cfg, out,
                          measure_only, speak=speak, workers=world.world_size if parallel else 1)
    finally:
        if parallel:
            leave_job(trainer, torch.device(run.train.device))
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if measure_only:
        return result
    if not speak:
        return result
    trainer = None
    _free_device_memory()  # the A/B runs' processes need the GPU's memory, not this one
    if argv is not None and not under_launcher():
        _ab(result, argv, cfg)
    write_outputs(out, result)
    return result


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _profile(workload, trainer, data, train, accel, cfg: ProfileConfig, out: Path,
             measure_only: bool, speak: bool, workers: int = 1) -> dict:
    """Steps 1-4 of the module doc on a built trainer; ``speak``: print (worker 0 of a
    data-parallel run, or the only process); ``workers``: how many train (the rates are
    this worker's)."""
    u = trainer.updater
    try:
        result = {"workload": workload.name, "device": str(u.device), "out": str(out),
                  "settings": {**vars(cfg), "batch_size": trainer.run_info["batch_size"],
                               "loader": train.loader,
                               "cpu_threads": trainer.setup.get("cpu_threads"),
                               "data": "synthetic" if data.synthetic else str(data.root)}}
        result.update(time_steps(u, cfg))
        if measure_only:
            return result
        result["workers"] = workers
        if speak:
            print(f"# {workload.name}  device: {u.device}  out: {out}"
                  + (f"  workers: {workers} (rates per worker)" if workers > 1 else ""),
                  file=sys.stderr)
            # Rates in the workload's unit: a language model's sequences counted in tokens.
            rates = [workload.units_per_sample * r for r in result["window_rates"]]
            rate = workload.units_per_sample * result["samples_per_s"]
            print(f"unprofiled: {rate:.1f} {workload.sample_unit}/s over "
                  f"{result['measured_steps']} steps ({min(rates):.1f}-{max(rates):.1f} over "
                  f"{len(rates)} windows), {format_phases(result['phases'])}", file=sys.stderr)
            for reason in result["stability"]["reasons"]:
                print(f"unstable: {reason}", file=sys.stderr)
        context = _context(workload, trainer, train, accel, result)
        figures = profile_updater(u, out, cfg.steps, cfg.warmup, context,
                                  samples_per_step=result["samples_per_step"], work_step=True,
                                  eager=lambda: eagerly(u.step_fn))
        figures = figures.restated(result["samples_per_step"], result["samples_per_s"],
                                   result["phases"].get("time/data%", 0.0))
        result["figures"] = figures.to_dict()
        result["verdict"] = judge(figures, accel)  # once: a Verdict until profile.json holds it
        if cfg.python:
            result["python_profile"] = str(_python_profile(u, out, cfg.steps))
    finally:
        close_run(trainer)
    return result


def _ab(result: dict, argv: list[str], cfg: ProfileConfig) -> None:
    """The candidate levers of ``result["verdict"]`` (a ``Verdict``) tried (unless
    ``cfg.estimate``) and the verdict advised from them; with ``cfg.confirm`` the bound's
    proof and the advice once more."""
    verdict: Verdict = result["verdict"]
    if not cfg.estimate:
        if any(c.change for c in verdict.candidates):
            print(f"trying the levers for {verdict.rule}, each beside the run as given "
                  f"({option('estimate')} skips this):", file=sys.stderr, flush=True)
        outcomes = ab.try_levers(argv, verdict.candidates, rounds=cfg.rounds)
        if outcomes:
            result["verdict"] = verdict = advise(verdict, outcomes)
    if cfg.confirm:
        print("confirming the bound and the advice:", file=sys.stderr, flush=True)
        result["ladder"] = ab.confirm(argv, verdict.experiments, verdict.lever,
                                      rounds=cfg.rounds)


def ab_saved(out: Path, argv: list[str], cfg: ProfileConfig) -> dict:
    """The A/B runs (``_ab``) of a data-parallel profile, from the process that launched its
    workers (worker 0 wrote ``out/profile.json``): each side launches its own workers. The
    report is written again; returns the result."""
    result = json.loads((Path(out) / "profile.json").read_text())
    result["verdict"] = Verdict.from_dict(result["verdict"])
    _ab(result, argv, cfg)
    write_outputs(Path(out), result)
    return result


def _context(workload, trainer, train, accel, result: dict) -> dict:
    """What the verdict needs beyond the trace (the loader, MFU...), and the run's levers as
    ``profile.json`` saves them (``config``: the verdict reads the ``AccelConfig`` itself)."""
    import dataclasses
    context = {"config": dataclasses.asdict(accel), "loader": train.loader,
               "batch_size": trainer.run_info["batch_size"],
               "has_conv": any(isinstance(m, torch.nn.Conv2d) for m in trainer.model.modules()),
               "has_blocks": checkpointable_blocks(trainer.model) is not None,
               "sharded": fsdp.is_sharded(trainer.model),
               "unprofiled_samples_per_s": result["samples_per_s"],
               "data_kind": dataset_kind(_dataset(trainer.train_loader)),
               **machine_facts(trainer.updater.device)}
    context.update(_mfu(workload, trainer, accel, result))
    if trainer.updater.device.type == "cuda":  # the update's bytes: the optimizer's roof
        context["optimizer_bytes"] = optimizer_bytes(trainer.updater.optimizer)
    if isinstance(trainer.updater.optimizer, KFAC):
        context.update(kfac_figures(result["phases"], trainer.updater.optimizer,
                                    result["measured_steps"]))
    return context


def _dataset(loader):
    """The dataset under a loader and the wrappers around it (a prefetcher's ``loader``)."""
    while loader is not None and not hasattr(loader, "dataset"):
        loader = getattr(loader, "loader", None)
    return getattr(loader, "dataset", None)


def cpu_bf16() -> dict:
    """This CPU's bf16 hardware as the verdict reads it (``window.machine_facts``)."""
    facts = machine_facts("cpu")
    return {"cpu_bf16": facts["cpu_bf16"], "cpu_bf16_isa": facts["cpu_bf16_isa"]}


def _mfu(workload, trainer, accel, result: dict) -> dict:
    """MFU (GPU) or the fraction of the CPU's fp32 peak, from the unprofiled step time."""
    device = trainer.updater.device
    batch = result["samples_per_step"]
    try:
        model = workload.build_model()
        flops = workload.step_flops(model, batch_spec(workload, model).make_batch,
                                    batch).total
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return {"mfu": None, "mfu_note": f"N/A: {exc}"}
    return peak_figures(device, flops, batch / result["samples_per_s"],
                        compute_dtype(Rung("run", accel)))


def peak_figures(device, flops: float | None, step_s: float, dtype: str) -> dict:
    """The figures of ``flops`` per step in ``step_s`` seconds against the ``dtype`` matmul
    peak measured on ``device`` now: ``mfu`` on a GPU, ``peak_fraction`` on a CPU (None and
    ``mfu_note``'s reason where withheld), the FLOPs and the peak beside them (and, on a
    CPU, its theoretical peak). A workload's FLOPs (``_mfu``) or a script's
    (``kasoku.commands.script_profile``)."""
    device = torch.device(device)
    try:
        peak = measure_matmul_peak(device, dtype, size=None if device.type == "cuda" else 1024)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return {"mfu": None, "mfu_note": f"N/A: {exc}"}
    value, note = compute_mfu(flops, step_s, peak.flops_per_s, dtype)
    key = "mfu" if device.type == "cuda" else "peak_fraction"
    out = {key: value, "mfu_note": note, "flops_per_step": flops, "peak_dtype": dtype,
           "peak_flops_per_s": peak.flops_per_s, "peak_stable": peak.stable,
           "peak_spread": peak.spread}
    if device.type == "cpu" and dtype in ("fp32", "bf16"):
        theory = cpuinfo.theoretical_peak(dtype)  # beside the measured one: an honest denominator
        if theory is not None:
            out.update(peak_theory=theory.to_dict(), peak_theory_text=theory.describe())
    return out


def _require_pyinstrument() -> None:
    try:
        import pyinstrument  # noqa: F401
    except ImportError:
        raise ConfigError(f"{option('python')} needs pyinstrument: pip install "
                          f"pyinstrument") from None


def _python_profile(u, out: Path, steps: int) -> Path:
    """pyinstrument's sampling profile of ``steps`` steps, as ``python.html`` and text."""
    from pyinstrument import Profiler
    profiler = Profiler(interval=0.0005)
    profiler.start()
    for _ in range(steps):
        u.update()
    sync(u.device)
    profiler.stop()
    path = out / "python.html"
    path.write_text(profiler.output_html())
    (out / "python.txt").write_text(profiler.output_text(unicode=False, color=False))
    return path


def write_outputs(out: Path, result: dict) -> None:
    """``timeline.png`` (where matplotlib is there) and ``report.html`` from the window's
    ``trace.json`` when ``result`` has figures, and ``profile.json``, into ``out``; a
    workload's profile or a script's (``kasoku.commands.script_profile``). Its verdict and
    figures are typed (``Verdict`` or a script's ``ScriptVerdict``, ``StepFigures``) or
    already as saved; ``profile.json`` holds their ``to_dict`` in their places."""
    figures, verdict = as_saved(result.get("figures")), as_saved(result.get("verdict"))
    png = None
    if figures is not None:
        try:
            # a script's steps keep its own numbers (the trace's first is the window's anchor)
            first = result["profiled_steps"][0] - 1 if "profiled_steps" in result else 1
            png = draw_timeline(trace_mod.load(out / "trace.json"), out / "timeline.png",
                                title=f"{result['workload']}: {verdict['rule']}",
                                first_step=first)
            result["timeline"] = str(png)
        except ImportError as exc:  # matplotlib is optional
            result["timeline"] = f"not drawn: {exc}"
        roof_png = None
        if figures.get("roofline"):
            roof_png = draw_roofline(figures["roofline"], figures["step_ms"],
                                     out / "roofline.png")
            result["roofline_png"] = str(roof_png) if roof_png else "not drawn: no matplotlib"
        result["report"] = str(write_report(
            out / "report.html", title=f"kasoku profile: {result['workload']}",
            verdict=verdict, figures=figures, phases=result.get("phases"),
            timeline_png=png, roofline_png=roof_png, ladder=result.get("ladder"),
            settings=result["settings"],
            python_profile=result.get("python_profile"), stability=result.get("stability")))
    (out / "profile.json").write_text(json.dumps(result, indent=1, default=_json))


_TYPED = (Verdict, ScriptVerdict, StepFigures)
"""The typed values of a result, each written as its ``to_dict``."""


def as_saved(value):
    """``value`` as ``profile.json`` holds it: a typed verdict's or figures' ``to_dict``."""
    return value.to_dict() if isinstance(value, _TYPED) else value


def _json(value):
    return value.to_dict() if isinstance(value, _TYPED) else str(value)
