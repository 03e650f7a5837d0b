"""``kasoku compare``: how much faster is the GPU than the CPU for this workload, with both
sides at their best, and how much of its own peak each side uses (seeds 001 and 002).

Per workload and device, the device's acceleration ladder runs through ``kasoku bench``'s
sweep (``run_sweep``: a fresh process per rung, warm-up apart, the median of timed windows,
the numerics guard, MFU against the matmul peak measured for the rung's dtype). The device's
best run is the fastest whose numerics check passed (``best_run``). From the best runs:

    speed-up    = best GPU rate / best CPU rate
    peak ratio  = the GPU's measured peak / the CPU's, each in its best rung's dtype
    share ratio = GPU MFU / CPU MFU (= speed-up / peak ratio: the model's FLOPs per sample
                  are the same on both)

and one line reading them (``reading``). Epoch times are extrapolated from the measured rate
to the workload's real epoch (``Workload.epoch_samples``). A workload whose step would take
long (ResNet-50 on a CPU) is timed on a shorter window (``plan_window``), said in the output.

Records: one line per workload, schema ``kasoku.compare/1``, appended to ``OUT/results.jsonl``;
each device's sweep keeps its own ``kasoku.bench/1`` lines in ``OUT/bench-WORKLOAD-DEVICE``
(``kasoku bench --report --out`` redraws its ladder). The table and ``compare.png`` are drawn
from the compare lines alone (``kasoku.commands.bench.compare_report``).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kasoku.commands.bench.pool import batch_spec
from kasoku.commands.bench.report import unstable
from kasoku.commands.bench.results import append_result, median_rate, read_results
from kasoku.commands.bench.rungs import ladder_or_specs
from kasoku.commands.bench.sweep import WINDOW_DEFAULTS, SweepConfig, run_sweep
from kasoku.core.flags import flag
from kasoku.core.interrupts import Stopped
from kasoku.perf.noise import ranges_meet
from kasoku.workloads import create_workload
from kasoku.workloads.registry import default_batch_sizes

SCHEMA = "kasoku.compare/1"
RESULTS_FILE = "results.jsonl"
CHART_FILE = "compare.png"
TIMED_BUDGET_S = {"cpu": 30.0, "cuda": 10.0}
"""Time a run's timed windows may take, by an estimate of the step: past it, fewer steps."""
ASSUMED_FLOPS_PER_S = {"cpu": 1e11, "cuda": 1e14}
"""A low guess of the device's training rate, only to size the window before measuring."""
SAME_SHARE = 1.1
"""Shares of the peaks within this factor of each other read as "about the same"."""


@dataclass(frozen=True)
class CompareConfig:
    workloads: tuple[str, ...]
    devices: tuple[str, ...]
    """``cpu``, ``cuda`` or ``cuda:N``, each at most once."""
    out: Path
    batch_sizes: tuple[int, ...] | None = None
    """None: the recipe's batch, on a CPU at most 100 (``default_batch_sizes``)."""
    configs: dict | None = None
    """Device type -> rung specs (``--cpu-config``, ``--gpu-config``); unset: the ladder."""
    steps: int | None = None
    """Steps per timed window (None: bench's default, shortened for long steps)."""
    windows: int = 3
    warmup: int | None = None
    numerics_steps: int = 10
    timeout_s: float = 900.0
    seed: int = 0
    threads: int | None = None
    peak_size: int | None = None
    scale: Path | None = None
    """A ``kasoku scale`` results file or folder: its 2-GPU rates fill the 2-GPU column."""


@dataclass(frozen=True)
class Window:
    """The timed steps of one device's sweep and why."""
    steps: int
    windows: int
    warmup: int
    estimated_step_s: float | None
    """At ``assumed_flops_per_s``: what sized the window, not a measurement."""
    assumed_flops_per_s: float
    shortened: bool

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "timed_steps": self.steps * self.windows}


def plan_window(flops_per_step: float | None, device_type: str, windows: int,
                steps: int | None = None, warmup: int | None = None) -> Window:
    """Steps per window: ``steps`` if given; else bench's default, cut so the timed windows
    take about ``TIMED_BUDGET_S`` at an assumed low rate (``ASSUMED_FLOPS_PER_S``), never
    below one step; a cut window has one warm-up step (the numerics phase before it has
    already absorbed compilation)."""
    default, assumed = WINDOW_DEFAULTS[device_type], ASSUMED_FLOPS_PER_S[device_type]
    est = flops_per_step / assumed if flops_per_step else None
    if steps is not None or est is None:
        return Window(steps or default["steps"], windows,
                      default["warmup"] if warmup is None else warmup, est, assumed, False)
    fit = max(1, math.floor(TIMED_BUDGET_S[device_type] / (windows * est)))
    shortened = fit < default["steps"]
    return Window(min(fit, default["steps"]), windows,
                  (1 if shortened else default["warmup"]) if warmup is None else warmup,
                  est, assumed, shortened)


def best_run(records: list[dict]) -> tuple[dict | None, str]:
    """The fastest ok run whose numerics check passed, and how it was chosen. Where the guard
    was off (every verdict "n/a") the fastest ok run, said so; a failed check never counts."""
    ok = [r for r in records if median_rate(r)]
    checked = [r for r in ok if r.get("numerics", {}).get("status") == "ok"]
    if checked:
        return max(checked, key=median_rate), "the fastest run whose numerics check passed"
    unchecked = [r for r in ok if r.get("numerics", {}).get("status") == "n/a"]
    if unchecked:
        return max(unchecked, key=median_rate), "the fastest run (numerics not checked)"
    return None, "no run finished with its numerics check passed"


def run_compare(cfg: CompareConfig, stream=None) -> tuple[list[dict], int]:
    """Sweep each workload on each device, append one ``kasoku.compare/1`` line per workload
    to ``cfg.out/results.jsonl`` and return the lines and the exit code (1 when a sweep had
    a failed run or a numerics failure, as ``kasoku bench``). A sweep a signal stopped stops
    the comparison too (``kasoku.core.interrupts.Stopped``), the lines of the workloads
    compared before it kept."""
    stream = stream or sys.stdout
    say = lambda *a: print(*a, file=stream, flush=True)  # noqa: E731
    compare_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    gpu2 = two_gpu_rates(cfg.scale) if cfg.scale else {}
    lines, code = [], 0
    for w, name in enumerate(cfg.workloads, 1):
        wl = create_workload(name)
        sides = {}
        for device in cfg.devices:
            dtype = torch.device(device).type
            side, sweep_code = _measure_side(cfg, name, wl, device, say, stream,
                                             f"[{w}/{len(cfg.workloads)}] {wl.name} on {device}")
            if sweep_code > 128:  # a signal stopped the sweep, which said what it kept
                raise Stopped(sweep_code - 128)
            sides[dtype] = side
            code = max(code, sweep_code)
        line = summarize(wl.name, wl.sample_unit, wl.epoch_samples, sides.get("cpu"),
                         sides.get("cuda"), gpu2.get(wl.name))
        line.update(schema=SCHEMA, form="throughput", compare_id=compare_id,
                    time=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        append_result(cfg.out, line, RESULTS_FILE)
        lines.append(line)  # its reading is said once, under the table (print_compare)
    return lines, code


def _measure_side(cfg: CompareConfig, name: str, wl, device: str, say, stream,
                  what: str) -> tuple[dict, int]:
    """One device's sweep of workload ``name`` (as given: the workers build it by that
    name), and its figures for the compare line."""
    device_type = torch.device(device).type
    sizes = cfg.batch_sizes or default_batch_sizes(wl.recipe.batch_size, "compare", device_type)
    model = wl.build_model()
    spec = batch_spec(wl, model)
    flops = wl.step_flops(model, spec.make_batch, max(sizes)).total
    window = plan_window(flops, device_type, cfg.windows, cfg.steps, cfg.warmup)
    rungs = tuple(ladder_or_specs(device_type, (cfg.configs or {}).get(device_type), wl.ladder))
    out = cfg.out / f"bench-{wl.name}-{device_type}"
    say(f"# {what}: {len(rungs)} rungs ({', '.join(r.label for r in rungs)}) at batch "
        f"{','.join(map(str, sizes))}; {window.warmup} warm-up + {window.windows} x "
        f"{window.steps} timed steps per run"
        + (f" (shortened: an estimated {window.estimated_step_s:.2g} s per step)"
           if window.shortened else "") + f"; ladder in {out}")
    sweep = SweepConfig(workload=name,
                        rungs=rungs, batch_sizes=tuple(sizes), out=out, device=device,
                        steps=window.steps, windows=window.windows, warmup=window.warmup,
                        numerics_steps=cfg.numerics_steps, timeout_s=cfg.timeout_s,
                        seed=cfg.seed, threads=cfg.threads if device_type == "cpu" else None,
                        peak_size=cfg.peak_size)
    result = run_sweep(sweep, stream=stream)
    best, how = best_run(result.records)
    return side_figures(best, how, window, out, device_type, wl.epoch_samples), \
        result.exit_code


def side_figures(best: dict | None, how: str, window: Window, out: Path, device_type: str,
                 epoch_samples: int | None) -> dict:
    """One device's figures in a compare line, from its best bench record (None: none)."""
    side = {"device": device_type, "chosen": how, "bench_out": str(out),
            "window": window.to_dict()}
    if best is None:
        return {**side, "rung": None, "samples_per_s": None}
    f = best["figures"]
    rate = median_rate(best)
    side.update(rung=best["rung"], batch_size=best["batch_size"],
                device_name=best.get("env", {}).get("device_name"),
                samples_per_s=rate, step_time_ms=(f.get("step_time_ms") or {}).get("median"),
                stability=f.get("stability"), unstable=unstable(best),
                rate_range={k: f["samples_per_s"].get(k, rate) for k in ("min", "max")},
                compute_dtype=f.get("compute_dtype"), peak_flops_per_s=f.get("peak_flops_per_s"),
                mfu=f.get("mfu"), mfu_note=f.get("mfu_note"),
                model_flops_per_step=f.get("model_flops_per_step"),
                numerics=(best.get("numerics") or {}).get("status"),
                sweep_id=best.get("sweep_id"),
                epoch_s=epoch_samples / rate if epoch_samples else None,
                epoch_extrapolated_from_steps=window.steps * window.windows)
    if device_type == "cpu":
        # The first-principles peak the bench worker's probe recorded beside the measured one:
        # of the cores it ran on (--threads), not of the whole CPU. None where kasoku has no
        # estimate for this CPU or dtype.
        theory = (f.get("peak") or {}).get("theory") or {}
        side["theoretical_peak_flops_per_s"] = theory.get("flops_per_s")
    return side


def two_gpu_rates(path: Path) -> dict[str, dict]:
    """Workload -> the latest 2-GPU record of a ``kasoku scale`` results file or folder
    (``kasoku.scale/1`` lines with 2 workers on CUDA): rate, rung and where it came from."""
    rates = {}
    for r in read_results(path):
        if r.get("schema") == "kasoku.scale/1" and r.get("world_size") == 2 \
                and r.get("device_type") == "cuda":
            rates[r["workload"]] = {"samples_per_s": r["samples_per_s"], "rung": r.get("rung"),
                                    "global_batch_size": r.get("global_batch_size"),
                                    "source": str(path)}
    return rates


def summarize(workload: str, unit: str, epoch_samples: int | None, cpu: dict | None,
              gpu: dict | None, gpu2: dict | None = None) -> dict:
    """A compare line's figures (less schema and time): both sides, the speed-up, the peak
    and share ratios and the reading."""
    line = {"workload": workload, "unit": unit, "epoch_samples": epoch_samples, "cpu": cpu,
            "cuda": gpu, "speedup": None, "peak_ratio": None, "share_ratio": None}
    if gpu2 is not None and epoch_samples:
        gpu2 = {**gpu2, "epoch_s": epoch_samples / gpu2["samples_per_s"]}
    line["cuda_2"] = gpu2
    c, g = (cpu or {}).get("samples_per_s"), (gpu or {}).get("samples_per_s")
    if c and g:
        line["speedup"] = g / c
        cp, gp = cpu.get("peak_flops_per_s"), gpu.get("peak_flops_per_s")
        if cp and gp:
            line["peak_ratio"] = gp / cp
        if cpu.get("mfu") and gpu.get("mfu"):
            line["share_ratio"] = gpu["mfu"] / cpu["mfu"]
        elif line["peak_ratio"]:
            line["share_ratio"] = line["speedup"] / line["peak_ratio"]
    line["reading"] = reading(line)
    return line


def times(x: float) -> str:
    """``140x``, ``12x``, ``3.4x``."""
    return f"{x:,.0f}x" if x >= 10 else f"{x:.1f}x"


def _share(side: dict) -> str:
    if side.get("mfu") is None:
        return "its share of its peak unknown"
    return f"{100 * side['mfu']:.0f}% of its {side['compute_dtype']} peak"


def _span(side: dict) -> str:
    span = side.get("rate_range") or {"min": side["samples_per_s"], "max": side["samples_per_s"]}
    return f"{span['min']:,.0f}-{span['max']:,.0f}"


def _ranges_meet(cpu: dict, gpu: dict) -> bool:
    """Whether the two best rungs' windows' ranges meet (a line saved before the ranges were
    kept: no)."""
    a, b = cpu.get("rate_range"), gpu.get("rate_range")
    return bool(a and b) and ranges_meet(a, b)


def _unsure(cpu: dict, gpu: dict, what: str = "the ratios are") -> str:
    """`` (the CPU's rate is unstable: ...)`` where a side's windows disagreed or shared its
    cores with other processes (``!`` in its ladder): the ratios below rest on it."""
    shaky = [(name, side) for name, side in (("CPU", cpu), ("GPU", gpu))
             if side.get("unstable")]
    if not shaky:
        return ""
    said = " and ".join(f"the {name}'s windows ranged {_span(side)}" for name, side in shaky)
    return f" (unstable: {said}; {what} approximate: measure again on a quiet machine)"


def reading(line: dict) -> str:
    """One line: which device is faster and by how much, the ratio of their peaks, and which
    uses the larger share of its own peak."""
    cpu, gpu = line.get("cpu") or {}, line.get("cuda") or {}
    c, g = cpu.get("samples_per_s"), gpu.get("samples_per_s")
    if not (c and g):
        if not cpu and not gpu:
            return "nothing was measured"
        for name, side, other in (("CPU", cpu, "GPU"), ("GPU", gpu, "CPU")):
            if side and not side.get("samples_per_s"):
                return (f"no {name} rung finished with its numerics check passed (see "
                        f"{side['bench_out']}): nothing to compare")
        name, side, other = ("CPU", cpu, "GPU") if c else ("GPU", gpu, "CPU")
        how = (f"add {flag('compare.devices')} cpu,cuda on a machine with a GPU" if other == "GPU"
               else f"add cpu to {flag('compare.devices')}")
        unsure = _unsure(cpu, gpu, "the figures are")
        return (f"only the {name} was measured: {side['rung']} at {side['samples_per_s']:,.0f} "
                f"{line['unit']}/s{unsure}, {_share(side)}; {how} for the comparison")
    speedup = line["speedup"]
    if _ranges_meet(cpu, gpu):
        return (f"the two devices' rates are within the noise of each other (CPU "
                f"{_span(cpu)}, GPU {_span(gpu)} {line['unit']}/s over their windows): no "
                f"faster device here" + _unsure(cpu, gpu))
    text = (f"the GPU is {times(speedup)} faster here" if speedup >= 1
            else f"the CPU is {times(1 / speedup)} faster here") + _unsure(cpu, gpu)
    if line.get("peak_ratio") is None:
        return text + "; no measured peak to compare the shares (the peak probe failed)"
    peak = line["peak_ratio"]
    text += (f"; its peak is {times(peak)} the CPU's" if speedup >= 1
             else f"; the GPU's peak is {times(peak)} the CPU's")
    share = line["share_ratio"]
    shares = (f" ({100 * cpu['mfu']:.0f}% of its {cpu['compute_dtype']} peak against "
              f"{100 * gpu['mfu']:.0f}% of its {gpu['compute_dtype']} peak)"
              if cpu.get("mfu") and gpu.get("mfu") else "")
    if share < 1 / SAME_SHARE:
        return text + ": the CPU path uses a larger share of its peak" + shares
    if share > SAME_SHARE:
        return text + ": the GPU uses a larger share of its peak" + shares
    return text + ": both use about the same share of their peaks" + shares
