"""Run ONE (workload, rung, batch size) in this process and report it as one JSON line.

    python -m kasoku.commands.bench.worker '{"workload": "mnist-mlp", "batch_size": 100,
        "rung": {"label": "fp32", "config": {"precision": "fp32", ...}, ...}, ...}'

Phases: build the model (seeded) and a pool of synthetic batches on the device (a rung fed by a
loader, ``--loader SPEC --data DIR``, takes its batches from that loader instead, pulled inside the
timed spans: ``kasoku.commands.bench.fed``); apply the rung; numerics (the first K steps on the
fixed batches, whose losses the sweep compares with the fp32 rung's, see
``kasoku.commands.bench.numerics``); warm-up (absorbing compilation, cuDNN autotuning and graph
capture: the first step is timed on its own, ``warmup_s`` covers both phases); then ``windows``
timed windows of ``steps`` steps; then, optionally, the kernel-time split (``kernels``) and a
profiled window (``profile_steps``: ``kasoku.perf.profile.window``) whose analysis the sweep judges
for the rung's bottleneck verdict. ``--numerics-only`` stops after the numerics phase.
``--probe-peak DTYPES`` instead measures matmul peaks (``kasoku.perf.peak``).

Test hooks (environment): ``KASOKU_BENCH_SIMULATE_OOM=64[,128]`` raises an out-of-memory
error at those batch sizes; ``KASOKU_BENCH_SIMULATE_DIVERGENCE=LABEL[,LABEL]`` multiplies the
learning rate of those rungs by 1e4, so the numerics guard has something to catch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch

from kasoku.accel.checkpointing import checkpointable_blocks
from kasoku.accel.config import AccelConfig
from kasoku.accel.cpu_threads import apply_cpu_threads
from kasoku.accel.graph import eagerly
from kasoku.accel.memory_format import has_conv2d
from kasoku.commands.bench.fed import FedBatches
from kasoku.commands.bench.numerics import DEFAULT_STEPS
from kasoku.commands.bench.pool import batch_spec, cycle, make_pool
from kasoku.commands.bench.rungs import Rung, compute_dtype
from kasoku.commands.bench.runner import StepRunner, make_runner
from kasoku.commands.bench.timing import measure_windows, settle, timed
from kasoku.commands.profile import cpu_bf16
from kasoku.core.flags import flag
from kasoku.core.phases import NoClock, no_mark
from kasoku.core.queues import request_queues
from kasoku.perf.activations import saved_activation_bytes
from kasoku.perf.cpuinfo import PEAK_DTYPES, theoretical_peak
from kasoku.perf.noise import MachineWatch, Stability, spread
from kasoku.perf.peak import measure_matmul_peak
from kasoku.perf.profile.figures import StepFigures
from kasoku.perf.profile.kernels import profile_steps
from kasoku.perf.profile.window import Window
from kasoku.perf.profile.work import optimizer_bytes
from kasoku.perf.sysinfo import environment
from kasoku.run import decode
from kasoku.train.step import markable
from kasoku.workloads import create_workload

OOM_ENV = "KASOKU_BENCH_SIMULATE_OOM"
DIVERGE_ENV = "KASOKU_BENCH_SIMULATE_DIVERGENCE"
DIVERGE_LR_SCALE = 1e4
PROFILE_WARMUP = 2
"""Profiler warm-up steps before the profiled ones (the profiler's own start-up lands there)."""
PROFILE_TOP = 5
"""Top kernels and top operators kept in the record (a line per run must stay short)."""
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class WorkerRequest:
    """One measurement, typed both ways (``to_json``, ``from_json``: the one argument of
    ``python -m kasoku.commands.bench.worker``). Not a ``kasoku.run.RunConfig``: a rung is a
    lever config or the plain PyTorch loop (``rung.config`` None, which no run has), stepped
    on the recipe's optimizer and learning rate, on synthetic batches unless the rung names a
    loader, in timed windows with no epochs, run folder, log or snapshots; and a run's
    data-parallel and K-FAC settings do not apply to one process timing one rung."""
    workload: str
    rung: Rung
    batch_size: int
    device: str = "cpu"
    steps: int = 20
    """Steps per timed window."""
    windows: int = 3
    warmup: int = 5
    """Warm-up steps after the numerics phase (which already absorbs compilation)."""
    numerics_steps: int = DEFAULT_STEPS
    seed: int = 0
    threads: int | None = None
    """CPU threads (None: the workload's preference, else PyTorch's default)."""
    pool_batches: int = 4
    numerics_only: bool = False
    kernels: int = 0
    """Steps profiled after the windows for the kernel-time split (``kasoku.perf.profile.kernels``);
    0: none."""
    data: str | None = None
    """The workload's dataset folder, for a rung fed by a loader (``rung.loader``)."""
    profile_steps: int = 6
    """Steps of the profiled window after the windows (and after ``kernels``), analysed into
    ``figures["profile"]`` for the sweep's bottleneck verdict; 0: none."""
    loader_cores: bool = True
    """On a CPU, the loader rung's workers on cores of their own (``kasoku.commands.bench.fed``)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerRequest:
        return decode(cls, json.loads(text))


def run(req: WorkerRequest) -> dict:
    """Measure one configuration; never raises for an OOM or a failing step: the returned
    record says ``status`` ("ok", "oom" or "error") and ``error`` (the error's last line)."""
    device = torch.device(req.device)
    wl = create_workload(req.workload)
    threads = req.threads or (wl.cpu_threads if device.type == "cpu" else None)
    # The loader rung splits the CPUs this process had before its threads were pinned.
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cpu_threads = _set_threads(device.type, threads)  # first: environment() records them
    record = {
        "workload": req.workload, "rung": req.rung.label, "batch_size": req.batch_size,
        "unit": wl.sample_unit, "device": device.type, "config": req.rung.config_dict(),
        "settings": {"steps_per_window": req.steps, "windows": req.windows,
                     "warmup_steps": req.warmup, "numerics_steps": req.numerics_steps,
                     "seed": req.seed, "pool_batches": req.pool_batches,
                     "cpu_threads": cpu_threads,
                     "watch_cpus": sorted(affinity) if affinity else None,
                     "optimizer": wl.recipe.optimizer, "lr": wl.recipe.lr,
                     "momentum": wl.recipe.momentum, "betas": wl.recipe.betas,
                     "weight_decay": wl.recipe.weight_decay},
        "env": environment(device), "status": "error", "error": None, "notes": [],
        "numerics": {"loss": None, "steps": req.numerics_steps},
        "figures": {"compute_dtype": compute_dtype(req.rung)},
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _measure(req, wl, device, record, affinity)
        record["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        record["status"] = "oom" if _is_oom(exc) else "error"
        record["error"] = _last_line(exc)
        if record["status"] == "error":
            traceback.print_exc(file=sys.stderr)
    record["figures"].update(_memory_peak(device))
    return record


def _measure(req: WorkerRequest, wl, device: torch.device, record: dict,
             affinity: set[int] | None = None) -> None:
    notes = record["notes"]
    torch.manual_seed(req.seed)
    model = wl.build_model()
    spec = batch_spec(wl, model)
    record["data"] = {"source": "synthetic on-device", **spec.describe()}
    simulated = os.environ.get(OOM_ENV, "")
    if str(req.batch_size) in [s.strip() for s in simulated.split(",")]:
        raise OutOfMemoryError(f"CUDA out of memory (simulated by {OOM_ENV}={simulated} at "
                               f"batch size {req.batch_size})")
    lr = wl.recipe.lr
    if req.rung.label in [s.strip() for s in os.environ.get(DIVERGE_ENV, "").split(",")]:
        lr *= DIVERGE_LR_SCALE
        notes.append(f"learning rate x{DIVERGE_LR_SCALE:g} by {DIVERGE_ENV} (test hook)")
    model = model.to(device)
    if req.rung.loader:
        if not req.data:
            raise ValueError(f"rung {req.rung.label} is fed by a loader: it needs "
                             f"{flag('data.root')} DIR")
        fed = FedBatches(wl, req.data, req.rung.loader, req.batch_size, device, seed=req.seed,
                         cores=req.loader_cores, threads=req.threads or wl.cpu_threads,
                         affinity=affinity)
        record["data"] = {**record["data"], **fed.describe(req.data)}
        if fed.cores:  # the split re-set the threads and pinning recorded at the start
            record["settings"]["cpu_threads"].update(fed.cores)
            record["env"]["torch_threads"] = torch.get_num_threads()
        try:
            _measure_steps(req, wl, model, device, lr, record, lambda n, start: fed.take(n))
        finally:
            fed.close()
        return
    pool = make_pool(spec, req.batch_size, device, req.pool_batches, seed=req.seed)
    _measure_steps(req, wl, model, device, lr, record,
                   lambda n, start: cycle(pool, n, start))


def _measure_steps(req: WorkerRequest, wl, model, device: torch.device, lr: float,
                   record: dict, batches) -> None:
    """The phases of the module doc on ``batches(n, start)``: the batches of steps start ..
    start + n - 1 (made lazily by a loader, inside the timed spans)."""
    figures, notes = record["figures"], record["notes"]
    runner = make_runner(req.rung, wl, model, device, lr, notes)

    # Numerics: the first K steps one at a time, every loss kept on the device (one sync at
    # the end; cloned, as a graphed step returns the same output tensor at every replay).
    # The first step, timed alone, holds compilation and graph capture; warm-up steps
    # follow. ``warmup_s`` covers all of these.
    k, losses = req.numerics_steps, []

    def one_by_one(start: int, n: int) -> None:
        for i in range(start, start + n):
            losses.append(runner(batches(1, i)).clone())

    _, first_s = timed(device, lambda: one_by_one(0, 1))
    _, rest_s = timed(device, lambda: one_by_one(1, k - 1))
    done = max(k, 1)
    figures["first_step_s"] = first_s
    if k:
        trajectory = torch.stack(losses).float().tolist()  # note: host sync, outside timing
        record["numerics"].update(loss=trajectory[-1], losses=trajectory)
        if req.numerics_only:
            return
    warm_s = 0.0
    if req.warmup:
        _, warm_s = timed(device, lambda: runner(batches(req.warmup, done)))
        done += req.warmup
    figures["warmup_s"] = first_s + rest_s + warm_s
    watch = MachineWatch(cpus=record["settings"].get("watch_cpus"), device=device).start()
    # Rates in the workload's unit: tokens/s for a language model's sequences.
    per_step = req.batch_size * wl.units_per_sample
    m, loss = measure_windows(runner, None, device, per_step, req.steps, req.windows,
                              start=done, batches=batches)
    extra = settle(runner, device, m, done, batches)
    figures.update(m.figures())
    figures["stability"] = Stability(spread(m.samples_per_s), watch.stop(), extra).to_dict()
    figures["final_loss"] = float(loss)
    done += req.steps * len(m.window_s)
    if checkpointable_blocks(model) is not None and not req.rung.is_plain \
            and not req.rung.loader:  # a batch of the pool, on the device already
        figures["saved_activation_bytes"] = _activation_bytes(wl, model, batches(1, done)[0],
                                                              req.rung.config, device)
    if req.kernels:
        start = done
        split = profile_steps(lambda: runner(batches(req.kernels, start)), device,
                              steps=req.kernels)
        figures["kernels"] = split.to_dict(top=10)
    if req.profile_steps:
        start = done + req.kernels
        figures["profile"] = _profile(req, runner, batches, start, device, model,
                                      figures["step_time_ms"]["median"], per_step)


def _activation_bytes(wl, model, batch, config: AccelConfig, device: torch.device) -> int:
    """The bytes one forward and loss keep for the backward pass
    (``kasoku.perf.activations``), after the timed windows: eager (``model.forward``, where
    a compiled model's code would hide its operators) under the rung's autocast."""
    x, y = batch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    autocast = (torch.autocast(device.type, dtype=dtype)
                if dtype is not None and (device.type == "cuda" or dtype == torch.bfloat16)
                else contextlib.nullcontext())

    def forward():
        with autocast:
            return wl.loss_fn(model.forward(x), y)
    return saved_activation_bytes(model, forward, keep=(x, y))


def _profile(req: WorkerRequest, runner, batches, start: int, device: torch.device,
             model, step_ms: float, per_step: int) -> dict:
    """The analysed profiled window (``profile_window``) with what the verdict needs of the
    run (batch size, convolutions, blocks, the CPU's bf16 units) and the shares of the step restated
    for the unprofiled step of ``step_ms`` (the windows' median), as ``kasoku profile`` does:
    the profiler slows the host, not the kernels. ``{"error": last line}`` when it fails: the
    rung's rate stands without its explanation. ``per_step``: the samples of a step in the
    workload's unit."""
    try:
        context = {"batch_size": req.batch_size, "has_conv": has_conv2d(model),
                   "has_blocks": checkpointable_blocks(model) is not None, **cpu_bf16()}
        if device.type == "cuda" and isinstance(runner, StepRunner):  # the update's roof
            context["optimizer_bytes"] = optimizer_bytes(runner.optimizer)
        figures = profile_window(runner, batches, start, device, req.profile_steps, context,
                                 per_step)
        figures = figures.restated(per_step, per_step / (step_ms / 1e3),
                                   0.0 if figures.data_pct is None else figures.data_pct)
    except Exception as exc:  # noqa: BLE001 - recorded, the rung is measured already
        traceback.print_exc(file=sys.stderr)
        return {"error": _last_line(exc)}
    return figures.to_dict()


def profile_window(runner, batches, start: int, device: torch.device, steps: int,
                   context: dict, samples_per_step: int) -> StepFigures:
    """Run ``PROFILE_WARMUP + steps`` steps on ``batches(1, start + i)`` under the profiler
    and return the trace's figures (``Window.analyse``) plus ``context``, without the verdict
    (the sweep judges with the MFU, known only there) and with the top lists cut to
    ``PROFILE_TOP``. The trace lives in a temporary folder, deleted after the analysis.

    Each step is marked as the analysis cuts it: ``data`` while the batch is taken (a loader
    rung loads it then), then the step's own marks (forward, backward, update, other) where
    its eager step takes them, else one ``compute``."""
    inner = markable(runner.step) if isinstance(runner, StepRunner) else None
    with tempfile.TemporaryDirectory(prefix="kasoku-bench-profile-") as tmp:
        eager = (lambda: eagerly(runner.step)) if isinstance(runner, StepRunner) else None
        window = Window(device, tmp, steps=steps, warmup=PROFILE_WARMUP, work_step=True,
                        eager=eager)
        clock = window.start(NoClock())  # the trace's spans only: nothing else to time
        if inner is not None:
            inner.mark = clock.mark
        try:
            i, last = start, False
            while not last:
                clock.mark("data")
                batch = list(batches(1, i))  # a loader rung pulls its batch here, in data
                if inner is None:
                    clock.mark("compute")
                runner(batch)
                i += 1
                last = window.step()
        finally:
            window.stop()
            if inner is not None:
                inner.mark = no_mark
        figures = window.analyse(context, samples_per_step)
    return figures.adding(**{key: figures.rest[key][:PROFILE_TOP]
                             for key in ("top_kernels", "top_operators") if key in figures.rest})


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, OutOfMemoryError) or "out of memory" in str(exc).lower()


def _last_line(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _memory_peak(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "mem_peak_kind": "torch.cuda.max_memory_allocated"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mem_peak_gib": kib / 2**20, "mem_peak_kind": "host max RSS of the process"}


def probe_peaks(device: str, dtypes: list[str], size: int | None, threads: int | None) -> dict:
    """``{dtype: PeakResult dict or {"error": ...}}``, measured in this process; on a CPU
    each also with ``theory``, the first-principles peak (``kasoku.perf.cpuinfo``), where
    one is known."""
    on_cpu = torch.device(device).type == "cpu"
    _set_threads(torch.device(device).type, threads)  # as the runs set them: their peak
    out = {}
    for dtype in dtypes:
        try:
            out[dtype] = measure_matmul_peak(device, dtype, size=size).to_dict()
            if on_cpu:
                theory = theoretical_peak(dtype) if dtype in PEAK_DTYPES else None
                out[dtype]["theory"] = theory.to_dict() if theory else None
        except (RuntimeError, ValueError) as exc:
            out[dtype] = {"error": _last_line(exc)}
    return out


def _set_threads(device_type: str, threads: int | None) -> dict | None:
    """A CPU's threads as ``apply_cpu_threads`` sets them (returns its record); elsewhere
    PyTorch's host threads, where ``threads`` is given (returns None)."""
    if device_type == "cpu":
        return apply_cpu_threads(threads)
    if threads:
        torch.set_num_threads(threads)
    return None


def config_from_dict(data: dict) -> AccelConfig | None:
    """The rung config a result records (``Rung.config_dict``): None for the plain loop."""
    data = dict(data)
    if data.pop("kind", "kasoku") == "plain":
        return None
    names = {f.name for f in dataclasses.fields(AccelConfig)}
    return AccelConfig(**{k: v for k, v in data.items() if k in names})


def main(argv: list[str] | None = None) -> int:
    """``python -m kasoku.commands.bench.worker JSON``: JSON is a ``WorkerRequest``
    (``WorkerRequest.to_json``), or ``{"probe_peak": [DTYPES], "device": ..., "size": ...,
    "threads": ...}`` for the matmul peaks; prints the record as one JSON line. The sweep
    starts it; it is not a command for users, so it takes no flags."""
    request_queues()  # as kasoku's main command line does (normally inherited from it)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kasoku.commands.bench.worker JSON (started by `kasoku bench`)",
              file=sys.stderr)
        return 2
    data = json.loads(argv[0])
    if "probe_peak" in data:
        result = probe_peaks(data.get("device", "cpu"), list(data["probe_peak"]),
                             data.get("size"), data.get("threads"))
        print(json.dumps(result))
        return 0
    record = run(WorkerRequest.from_json(argv[0]))
    sys.stdout.flush()
    print(json.dumps(record))
    return 1 if record["status"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
