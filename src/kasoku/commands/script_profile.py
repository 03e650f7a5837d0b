"""``kasoku profile -- python SCRIPT.py ARGS``: the verdict for a user's own training script,
run unchanged in this process (``kasoku.commands.script_run``) while kasoku watches its steps
from outside (``kasoku.commands.script_watch``): ``skip`` steps, ``measure_steps`` timed
without the profiler, then the profiled window; the verdict from the window's trace, its levers
in the script's terms (``kasoku.commands.script_levers``), those kasoku can pull from outside
measured in fresh runs of the script (``kasoku.commands.script_ab``), and, with ``--confirm``,
the bound proved by replaying the DataLoader's batches.

A script that starts its own DDP under torchrun: ``kasoku.commands.script_launch`` runs
torchrun with kasoku in each worker (this module, ``rank`` from the launcher's environment).

A window's trace over ``kasoku.perf.profile.window.TRACE_CAP_BYTES`` is not analysed: one line
says its size and how many steps fit, the unprofiled timing is kept (``measure.json``).

On a CPU the verdict's compute- and latency-bound rules read the step's share of the measured
matmul peak (``peak_fraction``). A workload's FLOPs are counted over its model; a script hands
kasoku no model, and the module its forward calls may be one of several (a GAN's two, a loss
module, a step that is more than one forward). The operators know: on a CPU the window's
steps are recorded with their shapes (``Window``'s ``cpu_shapes``), which give the FLOPs of
every matrix product and convolution the analysed steps ran (``work.product_flops``), the
forward's, the backward's and the optimizer's alike, whichever module ran them, and no step
more. Recording shapes costs the profiled steps a little host time and their trace about
half again its size; the verdict's step time is the unprofiled one. The fraction is those
FLOPs over the unprofiled step time and the peak of the dtype most of them ran in
(``kasoku.commands.profile.peak_figures``, the workload's way).

Not yet: the wait for a step's second batch (gradient
accumulation, a second loader: left in ``forward``).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from kasoku.accel.config import AccelConfig
from kasoku.advisor.script import ScriptVerdict
from kasoku.advisor.verdict import judge
from kasoku.commands import script_apply, script_levers, script_watch
from kasoku.commands.ab import ladder_lines, tried_lines
from kasoku.commands.profile import ProfileConfig, peak_figures, write_outputs
from kasoku.commands.profile_config import check_window
from kasoku.commands.script_ab import MEASURE_FILE, ScriptSides, advise_script
from kasoku.commands.script_launch import LAUNCHED
from kasoku.commands.script_levers import ScriptFacts, ScriptLevers, numerics, with_text
from kasoku.commands.script_preload import preload
from kasoku.commands.script_run import ScriptCommand, run_script
from kasoku.commands.script_watch import StepWatch
from kasoku.core.errors import ConfigError
from kasoku.core.flags import SCRIPT_COMMAND, option, profile_args
from kasoku.distributed import World
from kasoku.distributed.launch import under_launcher
from kasoku.perf.profile import window as window_mod
from kasoku.perf.profile.figures import profiler_cost
from kasoku.perf.profile.roofline import format_table
from kasoku.perf.profile.window import machine_facts
from kasoku.perf.profile.work import optimizer_bytes
from kasoku.train.run_dir import make_out_dir, out_or_new

EXIT_USAGE = 2
"""Nothing to profile from a script that ended well: the command asked for what it lacks."""

def profile_script(command: ScriptCommand, cfg: ProfileConfig, out: Path | None = None,
                   given: list[str] | None = None, measure_only: bool = False) -> int:
    """Run ``command`` under the step watch with the ``given`` levers (``--with``), time its
    steps, profile its window, judge it and measure its levers (``cfg.estimate``: not;
    ``cfg.confirm``: prove the bound and the advice), write ``profile.json``, ``trace.json``,
    ``timeline.png`` and ``report.html`` to ``out`` (default: a new folder under runs/) and
    print kasoku's lines (``kasoku: ...``, on stderr). Returns the exit code: the script's,
    else ``EXIT_USAGE`` when it ended well with nothing to profile. ``measure_only`` (a side
    of the A/B runs): the timed steps only (for ``cfg.measure_seconds`` at least, or to the
    script's end), then the script is stopped and the figures written to
    ``out/measure.json``."""
    check_window(cfg)
    levers = ScriptLevers.parse(given)
    preload(levers.allocator)  # this process again, the allocator in LD_PRELOAD (a side has it)
    if measure_only and out is None:
        raise ConfigError(f"{option('measure_only')} for a script writes its figures to "
                          f"{option('out')} DIR")
    rank = World.from_env().rank if under_launcher() else 0
    if measure_only:
        out = Path(out)
    elif rank == 0:
        out = out_or_new(out, Path(command.name).stem, "profile", "the profile")
    else:  # a worker of the script's own DDP under torchrun (kasoku.commands.script_launch)
        out = make_out_dir(Path(out) / f"worker{rank}", "a worker's trace")
    if rank == 0 and not measure_only:
        for value in levers.given:
            if numerics(value):
                say(f"{with_text(value)} changes what the script computes: "
                    f"{numerics(value)}")
    folder = Path.cwd()  # the sides' (the script may move its working directory)
    watch = StepWatch(cfg, out, levers, roots=(script_root(command),),
                      measure_only=measure_only)
    if rank == 0 and not measure_only:
        watch.on_window_end = lambda steps: say(runs_on_line(steps))
    # the levers' patches first: the watch takes its own off when its window ends, theirs stay
    with levers.applied(roots=watch.roots):
        watch.install()
        try:
            end = run_script(command, hidden=(__file__, script_watch.__file__,
                                                  script_levers.__file__, script_apply.__file__))
        finally:
            watch.uninstall()
            if watch.window is not None and not watch.done:
                watch.window.stop()
    if rank == 0 and not measure_only:
        for line in levers.unapplied_lines():
            say(line)
    if measure_only and not watch.done:
        watch.script_ended()  # its steps timed to its end, if as many as asked
    if watch.steps == 0:
        return _say_nothing(end) if rank == 0 else end.code or EXIT_USAGE
    speak = say if rank == 0 else (lambda line: None)
    if not watch.done and end.interrupted:
        speak(f"interrupted after {watch.steps} steps, before the window's end: nothing was "
              f"profiled")
        return end.code
    if not watch.done and end.raised:  # its traceback is above: it failed, it did not end
        speak(f"the script failed after {watch.steps} step{'s' * (watch.steps != 1)}, before "
              f"the window's end: nothing was profiled")
        return end.code
    if not watch.done:
        speak(f"the script ended after {watch.steps} steps, before the window's end "
              f"({window_text(cfg, measure_only)}: {watch.window_steps} steps): ask for fewer")
        return end.code or EXIT_USAGE
    if measure_only:
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            # a lever that did not apply: the side is no measure of it, and says why
            unapplied = "; ".join(levers.unapplied_lines())
            (out / MEASURE_FILE).write_text(json.dumps(
                {"error": unapplied} if unapplied else watch.measured))
        return 0
    if rank != 0:
        return end.code  # its trace is in out/workerR; worker 0 judges
    size = window_mod.trace_bytes(watch.window.trace_path)
    if size is not None:
        say(too_large_line(watch, size))
        (out / MEASURE_FILE).write_text(json.dumps(watch.measured))
        return end.code or EXIT_USAGE
    try:
        result = _result(command, cfg, watch, end)
    except ValueError as exc:  # a trace without two steps' spans (trace.steps_of)
        say(f"the window's trace could not be analysed: {exc}")
        return end.code or 1
    say(profiled_line(result))
    figures = result["figures"]
    if figures.roofline:
        for line in format_table(figures.roofline, figures.step_ms):
            say(line)
    if end.code:
        say(f"the script exited with code {end.code} after the window; the profile is kept")
    write_outputs(out, result)  # kept should the A/B runs be interrupted
    if os.environ.get(LAUNCHED):
        return end.code  # the process that launched torchrun measures the levers
    if under_launcher():
        say(f"under torchrun the levers are not measured from a worker: kasoku profile "
            f"{SCRIPT_COMMAND} torchrun ... measures them, each side a torchrun of its own")
        cfg = replace(cfg, estimate=True, confirm=False)
    elif end.interrupted:  # Ctrl-C: stop here, with the profile written
        say(f"interrupted: the levers were not measured (the profile is kept; "
            f"{option('estimate')} is what was said)")
        cfg = replace(cfg, estimate=True, confirm=False)
    sides = ScriptSides(command, cfg, levers.given, folder=folder)
    advise_script(result, watch.facts, sides, cfg, say)
    write_outputs(out, result)
    for line in verdict_lines(result):
        say(line)
    return end.code


def window_text(cfg: ProfileConfig, measure_only: bool = False) -> str:
    """The window's options as given: ``--skip 10, --measure-steps 20, ...``."""
    names = ("skip", "measure_steps") + (() if measure_only else ("warmup", "steps"))
    return ", ".join(" ".join(profile_args({name: getattr(cfg, name)})) for name in names)


def runs_on_line(steps: int) -> str:
    """Said when the window has ended at the script's step ``steps`` and the script runs on
    (no ``--stop-after-window``): the verdict is judged from the trace after the script ends,
    as judging it now would take the cores and memory the script is using."""
    return (f"the profile's window ended at step {steps}; the script runs on to its end, "
            f"then the verdict (judged after it, not to slow it down); Ctrl-C stops it now "
            f"and keeps the profile ({option('stop_after_window')} stops the script there)")


def too_large_line(watch: StepWatch, size: int) -> str:
    """Why the window was not analysed (its trace's ``size`` in bytes), the steps that would
    fit, and the unprofiled timing kept."""
    recorded = watch.cfg.steps + 1  # the anchor's trace is recorded too
    cap = window_mod.TRACE_CAP_BYTES
    fit = int(cap // (size / recorded)) - 1
    m = watch.measured
    todo = (f"profile fewer steps: {' '.join(profile_args({'steps': fit}))}" if fit >= 1 else
            f"even {' '.join(profile_args({'steps': 1}))} would record about "
            f"{2 * size / recorded / 1e6:.0f} MB: each step runs too many operators")
    return (f"the window's trace is too large to analyse: {size / 1e9:.2f} GB for "
            f"{recorded} profiled steps, over the {cap / 1e6:.0f} MB kasoku "
            f"reads; {todo} (measured without the profiler: {1e3 / m['steps_per_s']:.2f} ms "
            f"per step, {m['samples_per_s']:.1f} "
            f"{'samples' if watch.batch_size else 'steps'}/s, in {MEASURE_FILE})")


def script_root(command: ScriptCommand) -> Path:
    """The folder of the script's own files: its file's, or the working directory for a
    module."""
    return (command.path.resolve().parent if command.path is not None
            else Path.cwd().resolve())


def say(line: str) -> None:
    """One of kasoku's lines, kept apart from the script's output."""
    print(f"kasoku: {line}", file=sys.stderr, flush=True)


def _say_nothing(end) -> int:
    if end.raised:
        say("the script failed before its first step")
    elif end.code:
        say(f"the script exited with code {end.code} before its first step")
    else:
        say("the script ended without a training step (no optimizer step, no backward "
            "pass): nothing to profile")
    return end.code or EXIT_USAGE


def _result(command: ScriptCommand, cfg: ProfileConfig, watch: StepWatch, end) -> dict:
    """The script's result, ``profile.json`` once written (``write_outputs``): its figures a
    ``StepFigures``, its verdict a ``ScriptVerdict`` (advised by ``advise_script``)."""
    device, facts, measured = watch.window.device, watch.facts, watch.measured
    facts.batch_size = watch.batch_size
    facts.optimizer_impl = script_apply.optimizer_impl(watch.optimizer)
    loader = None if watch.num_workers is None else \
        "serial" if watch.num_workers == 0 else f"multiprocess:{watch.num_workers}"
    precision = {"bfloat16": "bf16", "float16": "fp16"}.get(facts.autocast or "", "fp32")
    context = {"loader": loader, "batch_size": watch.batch_size, "has_conv": facts.has_conv,
               "config": {"precision": precision},
               "unprofiled_samples_per_s": measured["samples_per_s"], **machine_facts(device)}
    if device.type == "cuda" and watch.optimizer is not None:  # the update's roof
        context["optimizer_bytes"] = optimizer_bytes(watch.optimizer)
    figures = watch.window.analyse(context, samples_per_step=watch.batch_size).restated(
        measured["samples_per_step"], measured["samples_per_s"],
        measured["phases"].get("time/data%", 0.0))
    flops = figures.rest.get("product_flops")
    if flops:  # a CPU's (the module's doc says why from the window's shapes)
        figures = figures.adding(**peak_figures(device, sum(flops.values()),
                                                1 / measured["steps_per_s"],
                                                max(flops, key=flops.get)))
    # once: typed (``StepFigures``, ``ScriptVerdict``) until profile.json holds them
    verdict = ScriptVerdict(judge(figures, script_accel(precision, facts)))
    first = cfg.skip + cfg.measure_steps + cfg.warmup + 2  # the anchor step is not analysed
    return {"workload": command.name, "script": list(command.argv), "device": str(device),
            "out": str(watch.out), "figures": figures, "verdict": verdict,
            "phases": measured["phases"], "stability": measured["stability"],
            "unprofiled": measured, "facts": vars(facts),
            "steps_seen": watch.steps, "profiled_steps": [first, first + cfg.steps - 1],
            "stopped_after_window": end.stopped, "script_exit_code": end.code,
            "settings": {"skip": cfg.skip, "measure_steps": cfg.measure_steps,
                         "warmup": cfg.warmup, "steps": cfg.steps, "loader": loader,
                         "batch_size": watch.batch_size, "with": list(watch.levers.given),
                         "script": command.text}}


def script_accel(precision: str, facts: ScriptFacts) -> AccelConfig:
    """The levers the script runs with, as kasoku's run fields, for the verdict to offer none
    of them again: its precision, the layout, compilation (CUDA graphs of the model with the
    modes that make them), a fused optimizer."""
    graphs = facts.compiled in ("reduce-overhead", "max-autotune")
    return AccelConfig(precision=precision, channels_last=facts.channels_last,
                       compile=facts.compiled is not None, cuda_graph=graphs,
                       optimizer_impl="fused" if facts.optimizer_impl == "fused" else None)


def profiled_line(result: dict) -> str:
    """What was timed and profiled: the unprofiled step, its spread, the wait for data."""
    m, f = result["unprofiled"], result["figures"]
    first, last = result["profiled_steps"]
    rates = m["window_rates"]
    unit = "samples" if result["settings"]["batch_size"] else "steps"
    return (f"{result['workload']}: {m['measured_steps']} steps timed on {result['device']}, "
            f"{f.step_ms:.2f} ms per step, {m['samples_per_s']:.1f} {unit}/s "
            f"({min(rates):.1f}-{max(rates):.1f} over {len(rates)} windows), waiting for data "
            f"{f.data_pct:.0f}%"
            + (f", copies to the GPU {f.h2d_ms:.2f} ms per step"
               + (" from pageable memory" if f.h2d_pageable else "")
               if f.h2d_ms else "")
            + f"; steps {first}-{last} profiled"
            + (f" ({cost})" if (cost := profiler_cost(
                f.to_dict(), rates, result["settings"]["batch_size"] or 1)) else "")
            + ("; the script stopped after the window" if result["stopped_after_window"]
               else ""))


def verdict_lines(result: dict) -> list[str]:
    """kasoku's lines for a script's verdict (``result["verdict"]``, a ``ScriptVerdict``):
    the verdict, what was tried, what needs an edit, the --confirm rows, whether the timed
    steps were unstable (``unstable_line``), the files."""
    v: ScriptVerdict = result["verdict"]
    label = "verdict" if v.measured else "verdict (estimate: no lever measured)"
    lines = [f"{label}: {v.line}"]
    lines += tried_lines(v.verdict)
    if v.lever.caveat:
        lines.append(f"  note: {v.lever.caveat}")
    for edit in v.edits or []:
        if edit.text != v.lever.text:
            lines.append(f"  also (an edit, not measured): {edit.text}")
    lines += [f"  also: {also}" for also in v.verdict.secondary]
    lines += ladder_lines(result.get("ladder"))
    if v.unconfirmed:
        lines.append(f"  not confirmed (each needs an edit to the script): "
                     f"{'; '.join(v.unconfirmed)}")
    busy = unstable_line(result.get("stability"))
    if busy:
        lines.append(busy)
    lines.append(f"report: {result.get('report')}  trace: {result['out']}/trace.json")
    return lines


def unstable_line(stability: dict | None) -> str | None:
    """What the terminal says of timed steps that were unstable (``Stability.to_dict``: its
    reasons, a busy machine's among them), or None where they were stable: the figures and the
    advice drawn from them follow the noise, an estimate to measure again."""
    if not stability or stability.get("stable", True):
        return None
    reasons = "; ".join(stability.get("reasons") or ()) or "their rates disagreed"
    return (f"unstable: the machine was busy or the steps' rates varied while they were timed "
            f"({reasons}): the figures and the advice are estimates; measure again on a quiet "
            f"machine")
