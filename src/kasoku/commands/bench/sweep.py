"""The sweep: every (rung, batch size) in a fresh process (``python -m
kasoku.commands.bench.worker``) with a timeout, so no run inherits another's allocator state,
compiled code or autotuning.

An OOM, a crash or a timeout is recorded (status and the error's last line) and the sweep goes
on. The matmul peaks MFU needs are measured once per (device, dtype) in a process of their own
before the runs. The fp32 reference rung runs first at each batch size, so every other run's
numerics verdict is known when its line is written: lines reach ``results.jsonl`` as runs end,
and an interrupted sweep keeps what it measured.

Each run also profiles a short window (``profile_steps``) whose figures it records; the
bottleneck verdict (``kasoku.advisor.verdict``) is judged here, once the run's MFU is
known, and recorded beside them, so the ladder says why each rung is as fast as it is.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kasoku.accel.checkpointing import checkpointable_blocks
from kasoku.accel.config import AccelConfig
from kasoku.accel.memory_format import has_conv2d
from kasoku.advisor.verdict import judge
from kasoku.commands.bench import fed, numerics
from kasoku.commands.bench.interrupted import interrupted_lines, missing_runs
from kasoku.commands.bench.pool import batch_spec
from kasoku.commands.bench.process import parse_record, run_process
from kasoku.commands.bench.report import data_label, plot_ladder, print_ladder
from kasoku.commands.bench.results import SCHEMA, append_result, median_rate
from kasoku.commands.bench.rungs import (
    REFERENCE_LABEL,
    Rung,
    compute_dtype,
    reference_rung,
    resolve,
)
from kasoku.commands.bench.summary import conclusion, progress_line, windows_text
from kasoku.commands.bench.worker import WorkerRequest
from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.core.interrupts import signal_of
from kasoku.perf.mfu import compute_mfu
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.sysinfo import environment
from kasoku.train.run_dir import make_out_dir, new_folders, remove_empty
from kasoku.workloads import create_workload

WINDOW_DEFAULTS = {"cuda": {"steps": 20, "warmup": 5}, "cpu": {"steps": 30, "warmup": 3}}
"""``kasoku bench``'s steps per timed window and warm-up steps, by device type."""


@dataclass(frozen=True)
class SweepConfig:
    workload: str
    rungs: tuple[Rung, ...]
    batch_sizes: tuple[int, ...]
    out: Path
    device: str = "cpu"
    steps: int = 20
    """Steps per timed window."""
    windows: int = 3
    """Timed windows per run (the median is reported; n >= 3 for a robust median)."""
    warmup: int = 5
    """Warm-up steps after the numerics phase."""
    numerics_steps: int = numerics.DEFAULT_STEPS
    """Steps of the numerics guard (0 turns it off)."""
    timeout_s: float = 900.0
    """Per run, process start to exit."""
    seed: int = 0
    threads: int | None = None
    pool_batches: int = 4
    peak_size: int | None = None
    """Matmul size of the peak probe (None: the device's default)."""
    kernels: int = 0
    """Steps profiled per run for the kernel-time split (0: none)."""
    data: Path | None = None
    """The workload's dataset: adds the loader rung (``kasoku.commands.bench.fed``)."""
    loader: str | None = None
    """The loader rung's loader spec (None: kasoku's pick, ``fed.fastest_loader``)."""
    profile_steps: int = 6
    """Steps of each run's profiled window, judged for its bottleneck verdict (0: none)."""
    loader_cores: bool = True
    """On a CPU, the loader rung's workers on cores of their own."""
    more: str | None = None
    """What the closing line says to run for more (the whole ladder, after the short one)."""
    argv: tuple[str, ...] = ()
    """The command's words after ``kasoku``: an interrupted sweep's commands to finish it."""


@dataclass
class SweepResult:
    records: list[dict]
    notes: list[str] = field(default_factory=list)
    chart: Path | None = None
    interrupted: int = 0
    """The signal that stopped the sweep (0: none): the records are the runs it finished."""

    @property
    def numerics_failures(self) -> list[dict]:
        return [r for r in self.records if r.get("numerics", {}).get("status") == "FAIL"]

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.records if r["status"] in ("error", "timeout")]

    @property
    def exit_code(self) -> int:
        """0, or 1 when a rung broke training or a run crashed or timed out (an OOM is a
        result, not a failure); 128 + N when signal N stopped it (130: Ctrl-C)."""
        if self.interrupted:
            return 128 + self.interrupted
        return 1 if self.numerics_failures or self.errors else 0


def run_sweep(cfg: SweepConfig, stream=None) -> SweepResult:
    """Run the sweep, print progress, the table and notes to ``stream`` (stdout), append one
    line per run to ``cfg.out / results.jsonl`` and draw ``cfg.out / ladder.png``."""
    stream = stream or sys.stdout
    say = lambda *a: print(*a, file=stream, flush=True)  # noqa: E731
    rungs, notes, flops = _prepare(cfg, say)
    created = new_folders(cfg.out)  # removed again if an interruption leaves them empty
    make_out_dir(cfg.out, "results.jsonl and ladder.png")  # before the first run, not after
    sweep_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    reference = next((r for r in rungs if r.label == REFERENCE_LABEL and not r.is_plain), None)
    # The reference first, so every other run's numerics verdict is known when it is written.
    ordered = ([reference] if reference else []) + [r for r in rungs if r is not reference]
    records: list[dict] = []
    total = len(ordered) * len(cfg.batch_sizes)
    interrupted = 0
    try:
        peaks = _probe_peaks(cfg, sorted({compute_dtype(r) for r in rungs if not r.skip}), say)
        references = {} if reference else _reference_losses(cfg, say)
        _run_all(cfg, ordered, references, reference, flops, peaks, sweep_id, records, say,
                 stream)
    except KeyboardInterrupt as exc:  # the runs so far are the result: their table and chart
        interrupted = signal_of(exc)
        lines = interrupted_lines(interrupted, len(records), total,
                                  missing_runs(rungs, cfg.batch_sizes, records),
                                  list(cfg.argv) or ["bench", cfg.workload], cfg.out,
                                  removed=not records and remove_empty(created))
        say("\n" + lines[0])  # at once; what is left to measure after the table
    order = {r.label: i for i, r in enumerate(rungs)}
    records.sort(key=lambda r: (order[r["rung"]], r["batch_size"]))
    run_notes = _run_notes(records)
    result = SweepResult(records, notes + run_notes, interrupted=interrupted)
    if records:
        _finish(cfg, result, run_notes, say, stream)
    for line in lines[1:] if interrupted else []:
        say(line)
    return result


def _run_all(cfg, ordered, references, reference, flops, peaks, sweep_id, records, say,
             stream) -> None:
    """Every (rung, batch size) in turn, each record appended to ``records`` and to
    ``results.jsonl`` as it ends."""
    total = len(ordered) * len(cfg.batch_sizes)
    for rung in ordered:
        for bs in cfg.batch_sizes:
            print(f"[{len(records) + 1}/{total}] {rung.label} bs {bs} ... ", end="",
                  file=stream, flush=True)
            if rung.skip:
                rec = _stub_record(cfg, rung, bs)
                rec.update(status="skipped", error=rung.skip, wall_s=0.0, schema=SCHEMA,
                           sweep_id=sweep_id)
                rec["env"]["note"] = "host side only: the rung was not run"
                append_result(cfg.out, rec)
                records.append(rec)
                say(rung.skip)
                continue
            rec = _run_worker(cfg, rung, bs)
            if rung is reference:
                references[bs] = rec.get("numerics", {}).get("losses")
            _judge(rec, rung, references.get(bs), rung is reference)
            rec["figures"].update(model_flops_per_step=flops[bs].total,
                                  flops_method=flops[bs].method)
            _add_mfu(rec, peaks.get(compute_dtype(rung)))
            _add_verdict(rec, rung)
            rec.update(schema=SCHEMA, sweep_id=sweep_id)
            append_result(cfg.out, rec)
            records.append(rec)
            say(progress_line(rec))


def _prepare(cfg: SweepConfig, say):
    """The rungs that apply here (notes said once) and the model FLOPs per batch size,
    counted here once on a meta-device copy (a rung changes no product of the model)."""
    wl = create_workload(cfg.workload)
    model = wl.build_model()
    rungs, notes = resolve(list(cfg.rungs), torch.device(cfg.device).type, has_conv2d(model),
                           checkpointable_blocks(model) is not None)
    for rung in rungs:
        if rung.config is not None and rung.config.steps_per_call != 1:
            raise ConfigError(f"rung {rung.label}: kasoku bench times one batch per step; "
                              f"steps_per_call={rung.config.steps_per_call} is for `kasoku "
                              f"train {flag('accel.steps_per_call')}`")
    if cfg.data is not None:
        base = next((r for r in reversed(rungs) if not r.is_plain), rungs[-1])
        rungs.append(Rung(fed.LABEL, base.config, loader=cfg.loader or fed.FASTEST))
        which = f"the {cfg.loader} loader" if cfg.loader else "the loader kasoku picks"
        notes.append(f"{fed.LABEL}: the {base.label} rung fed by {which} from {cfg.data}")
    for note in notes:
        say(f"note: {note}")
    spec = batch_spec(wl, model)
    flops = {bs: wl.step_flops(model, spec.make_batch, bs) for bs in cfg.batch_sizes}
    return rungs, notes, flops


def _reference_losses(cfg: SweepConfig, say) -> dict[int, list[float] | None]:
    """The fp32 reference's first-K losses per batch size, when no fp32 rung is measured."""
    references: dict[int, list[float] | None] = {}
    if not cfg.numerics_steps:
        return references
    for bs in cfg.batch_sizes:
        say(f"numerics reference (fp32, {cfg.numerics_steps} steps) bs {bs} ...")
        rung = reference_rung(torch.device(cfg.device).type)
        rec = _run_worker(cfg, rung, bs, numerics_only=True)
        references[bs] = rec.get("numerics", {}).get("losses")
    return references


def _run_worker(cfg: SweepConfig, rung: Rung, batch_size: int, numerics_only=False) -> dict:
    req = WorkerRequest(cfg.workload, rung, batch_size, cfg.device, steps=cfg.steps,
                        windows=cfg.windows, warmup=cfg.warmup,
                        numerics_steps=cfg.numerics_steps, seed=cfg.seed, threads=cfg.threads,
                        pool_batches=cfg.pool_batches, numerics_only=numerics_only,
                        kernels=0 if numerics_only else cfg.kernels,
                        profile_steps=0 if numerics_only else cfg.profile_steps,
                        data=str(cfg.data) if rung.loader else None,
                        loader_cores=cfg.loader_cores)
    cmd = [sys.executable, "-m", "kasoku.commands.bench.worker", req.to_json()]
    t0 = time.perf_counter()
    status, stdout, stderr = run_process(cmd, cfg.timeout_s)
    wall_s = time.perf_counter() - t0
    record = parse_record(stdout)
    if record is None:
        record = _stub_record(cfg, rung, batch_size)
        if status == "timeout":
            record.update(status="timeout", error=f"no result within {cfg.timeout_s:g} s")
        else:
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            record["error"] = lines[-1].strip() if lines else f"worker exited with {status}"
    if record["status"] in ("error", "timeout"):
        # The whole stderr of a failed run, for debugging on a machine one cannot log into.
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in rung.label)
        log = cfg.out / "logs" / f"{safe}_bs{batch_size}.stderr.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(stderr)
        record["log"] = str(log)
    record.update(time=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  wall_s=wall_s)
    return record


def _stub_record(cfg: SweepConfig, rung: Rung, batch_size: int) -> dict:
    """What is known of a run whose process died without a report (host-side environment
    only: the parent never initializes CUDA, so its memory stays the runs')."""
    env = environment(None)
    env.update(device_type=torch.device(cfg.device).type, device_name=None, device_count=None,
               note="host side only: the run died before reporting its device")
    return {"workload": cfg.workload, "rung": rung.label, "batch_size": batch_size,
            "device": torch.device(cfg.device).type, "config": rung.config_dict(),
            "settings": {"steps_per_window": cfg.steps, "windows": cfg.windows,
                         "warmup_steps": cfg.warmup, "numerics_steps": cfg.numerics_steps,
                         "seed": cfg.seed, "pool_batches": cfg.pool_batches},
            "env": env, "status": "error", "error": None, "notes": [],
            "numerics": {}, "figures": {"compute_dtype": compute_dtype(rung)}}


def _probe_peaks(cfg: SweepConfig, dtypes: list[str], say) -> dict[str, dict]:
    threads = cfg.threads or create_workload(cfg.workload).cpu_threads
    probe = {"probe_peak": dtypes, "device": cfg.device, "size": cfg.peak_size,
             "threads": threads if torch.device(cfg.device).type == "cpu" else None}
    cmd = [sys.executable, "-m", "kasoku.commands.bench.worker", json.dumps(probe)]
    say(f"measuring matmul peaks ({', '.join(dtypes)}) on {cfg.device} ...")
    status, stdout, stderr = run_process(cmd, cfg.timeout_s)
    peaks = {}
    try:
        peaks = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        say(f"note: peak probe failed ({lines[-1] if lines else status}); MFU is N/A")
    for dtype, peak in peaks.items():
        if "flops_per_s" in peak:
            # the first-principles peak beside it is said once, under the table (peak_lines)
            say(f"  {dtype}: {peak['flops_per_s'] / 1e12:.2f} TFLOP/s ({peak['size']}^3, "
                f"median of {peak['reps']}, {peak['threads']} threads)")
        else:
            say(f"  {dtype}: probe failed: {peak.get('error')}")
    return peaks


def _judge(rec: dict, rung: Rung, reference: list[float] | None, is_reference: bool) -> None:
    precision = "fp32" if rung.is_plain else rung.config.precision
    got = rec.get("numerics", {})
    # A fed rung's batches are real data: its losses are only checked for being finite.
    verdict = numerics.check(got.get("losses"), None if rung.loader else reference, precision,
                             is_reference)
    if rung.loader and verdict.status == "n/a":
        verdict = replace(verdict, reason=fed.NUMERICS_REASON)
    rec["numerics"] = {"losses": got.get("losses"), "loss": got.get("loss"),
                       **verdict.to_dict()}


def _add_mfu(rec: dict, peak: dict | None) -> None:
    figures = rec["figures"]
    dtype = figures.get("compute_dtype")
    step_ms = (figures.get("step_time_ms") or {}).get("median")
    rate = peak.get("flops_per_s") if peak else None
    value, note = compute_mfu(figures.get("model_flops_per_step"),
                              step_ms / 1e3 if step_ms else None, rate, dtype)
    figures.update(peak_flops_per_s=rate, peak=peak, mfu=value, mfu_note=note)
    theory = (peak or {}).get("theory")
    if theory:  # a CPU's: MFU against its first-principles peak too
        value, note = compute_mfu(figures.get("model_flops_per_step"),
                                  step_ms / 1e3 if step_ms else None, theory["flops_per_s"],
                                  f"first-principles {dtype}")
        if value is not None:
            note = f"counted model FLOPs / first-principles {dtype} peak (kasoku.perf.cpuinfo)"
        figures.update(mfu_theory=value, mfu_theory_note=note)


def _add_verdict(rec: dict, rung: Rung) -> None:
    """``rec["verdict"]``: the bottleneck verdict of the run's profiled window
    (``figures["profile"]``), judged with the context the run cannot know alone (its MFU) or
    that the record holds already (levers, batch size, loader). A run that failed, or whose
    window failed, gets none; a verdict that cannot be judged records ``{"error": ...}``."""
    profile = rec["figures"].get("profile")
    if rec["status"] != "ok" or not profile or "error" in profile:
        return
    f = rec["figures"]
    context = {"batch_size": rec["batch_size"], "loader": rung.loader or "synthetic on-device",
               "mfu": f.get("mfu")}
    if profile.get("device") == "cpu" and f.get("compute_dtype") == "fp32":
        context["peak_fraction"] = f.get("mfu")  # the CPU rule says "of its fp32 peak"
    try:
        figures = StepFigures.from_dict(profile).adding(**context)
        # a plain rung is PyTorch's loop: none of kasoku's levers on
        rec["verdict"] = judge(figures, rung.config or AccelConfig()).to_dict()
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        # A figure the rule's sentence needs is missing: the run's rate still stands.
        rec["verdict"] = {"error": f"{type(exc).__name__}: {exc}"}


def _run_notes(records: list[dict]) -> list[str]:
    seen, notes = set(), []
    for rec in records:
        for note in rec.get("notes", []):
            if note not in seen:
                seen.add(note)
                notes.append(f"{rec['rung']}: {note}")
    return notes


def _finish(cfg: SweepConfig, result: SweepResult, run_notes: list[str], say, stream) -> None:
    records = result.records
    say("")
    env = next((r["env"] for r in records if r.get("env", {}).get("device_name")), {})
    title = (f"{cfg.workload} on {env.get('device_name', cfg.device)} "
             f"(torch {env.get('torch', torch.__version__)}, {data_label(records)}, "
             f"{windows_text(records, cfg.windows)} x {cfg.steps} steps)"
             + (f", interrupted after {len(records)} run{'s' * (len(records) != 1)}"
                if result.interrupted else ""))
    print_ladder(records, title=title, file=stream)
    for note in run_notes:
        say(f"note: {note}")
    for rec in result.numerics_failures:
        say(f"NUMERICS FAIL: {rec['rung']} at bs {rec['batch_size']}: "
            f"{rec['numerics']['reason']}")
    for rec in result.errors:
        say(f"RUN FAILED: {rec['rung']} at bs {rec['batch_size']}: {rec['status']}: "
            f"{rec.get('error')}" + (f" (log: {rec['log']})" if rec.get("log") else ""))
    if any(median_rate(r) for r in records):
        result.chart = plot_ladder(records, cfg.out / "ladder.png", title)
    say(f"results: {cfg.out / 'results.jsonl'}" +
        (f", chart: {result.chart}" if result.chart else ""))
    say(conclusion(records, cfg.more))
