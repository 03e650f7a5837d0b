"""All-reduce bandwidth on PyTorch's own collectives (``torch.distributed.all_reduce`` over
NCCL on GPUs, gloo on the CPU), reported as nccl-tests reports it: what data-parallel
training's gradient all-reduce can get on this machine, before any training is built on it.

Per message size, each of N processes (one per GPU, or N CPU processes) runs ``warmup``
all-reduces, then ``reps`` timed batches of ``iters`` all-reduces, each batch started after a
barrier (and, on a GPU, a synchronize) and timed with CUDA events (GPU) or ``perf_counter``
(CPU). A batch's time per all-reduce is the slowest rank's (the collective is not done before
its last rank is); the reported time is the median over the batches. Then, as nccl-tests:

    algbw = bytes / time                    (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw * 2 (n - 1) / n           (busbw = algbw for n = 1)

busbw is what each link carried with a ring all-reduce, comparable with the hardware's link
bandwidth whatever n is (one process moves no data: its time is the call's own cost, ~27 us
for NCCL on an H100 with torch 2.11). Timed buffers hold zeros, so repeated sums neither overflow nor go
denormal; one all-reduce of ones before the warm-up checks every element (``wrong``).

Which algorithm NCCL picks (Ring, Tree, NVLS, CollNet...) torch does not say: records name
``NCCL_ALGO`` when it is set (NCCL then uses it) and say "backend's choice" otherwise. To see
or steer the choice: ``NCCL_ALGO=Ring`` (or Tree, NVLS...) forces one, to compare;
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING`` makes NCCL print its topology and tuning
decisions (what they show depends on NCCL's version). Every ``NCCL_*`` variable set is
recorded (``nccl_env``).

Launching: ``run_allreduce_bench`` starts each world size with PyTorch's elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun --standalone`` runs: a c10d
rendezvous on a free local port, a fresh run id). The entrypoint is a binary, ``python -m
kasoku.dist.allreduce_bench REQUEST_JSON``, not a Python function: each worker is a fresh
interpreter that pickles nothing and re-imports no ``__main__`` (a function entrypoint is
spawned through multiprocessing, which re-runs the caller's main module and fails for
functions it cannot import by name), and the same command runs under ``torchrun`` or a
scheduler, on several machines, unchanged. Workers find their place in the launcher's
environment (``init_process_group`` from ``RANK``/``WORLD_SIZE``/``MASTER_*``; NCCL on
GPU ``LOCAL_RANK``). Rank 0 writes one JSON line per size to the request's ``results`` file as
soon as it is measured; the launching process appends them to ``OUT/results.jsonl`` (schema
``kasoku.allreduce_bench/1``), prints the table and draws ``busbw.png``.

Test hook (environment): ``KASOKU_ALLREDUCE_SIMULATE_FAILURE=RANK`` makes that rank fail after
the process group is up, so the failure path can be tested.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from kasoku.errors import ConfigError, warn_once

SCHEMA = "kasoku.allreduce_bench/1"
RESULTS_FILE = "results.jsonl"
CHART_FILE = "busbw.png"
DTYPES = ("fp32", "bf16", "fp16")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30
MIN_SIZE = 4 * KiB
"""The smallest size of the default ladder."""
DEFAULT_MAX_SIZE = {"cuda": 256 * MiB, "cpu": 64 * MiB}
"""The top of the default ladder: 256 MiB on GPUs, 64 MiB on the CPU (a 256 MiB all-reduce
over gloo takes 0.2-0.4 s between 2 processes on a 2-core VM: the 105 of a size would add
half a minute per world size)."""
BACKEND_CHOICE = "backend's choice"
FAIL_ENV = "KASOKU_ALLREDUCE_SIMULATE_FAILURE"
SHUTDOWN_TIMEOUT_S = 5
"""Seconds the launcher gives the other workers to stop after one fails, before SIGKILL."""


@dataclass(frozen=True)
class AllReduceConfig:
    sizes: tuple[int, ...]
    """Message sizes in bytes, each a whole number of elements of ``dtype``."""
    dtype: str = "fp32"
    """Element type of the reduced tensors: fp32, bf16 or fp16."""
    warmup: int = 5
    """Untimed all-reduces per size before the timed batches."""
    iters: int = 20
    """All-reduces per timed batch."""
    reps: int = 5
    """Timed batches per size; the median is reported."""
    timeout_s: float = 300.0
    """Seconds the process group waits for a collective (or its start) before failing."""


class BenchFailed(RuntimeError):
    """A worker of the benchmark failed or could not start: the message is one line naming
    the world size, the rank and its error."""


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4K``, ``1M``, ``2G`` (powers of 1024, as nccl-tests; ``KiB``,
    ``KB`` and lower case are taken too). Anything else, or 0, is a ``ConfigError``."""
    raw = text.strip()
    body = raw.upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(body[-1:], 1)
    digits = body[:-1] if scale > 1 else body
    if not digits.isdigit() or int(digits) * scale < 1:
        raise ConfigError(f"size {text!r}: give bytes as N, NK, NM or NG (powers of 1024), "
                          f"e.g. 4K,1M,64M")
    return int(digits) * scale


def format_size(size_bytes: int) -> str:
    """``4K``, ``1M``, ``256M``, ``3G``; bytes when no unit divides them."""
    for unit, scale in (("G", GiB), ("M", MiB), ("K", KiB)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return str(size_bytes)


def default_sizes(max_size: int, min_size: int = MIN_SIZE) -> list[int]:
    """``min_size``, x4, x4, ... up to ``max_size`` (which ends the list when the steps miss
    it)."""
    sizes, size = [], min(min_size, max_size)
    while size < max_size:
        sizes.append(size)
        size *= 4
    return sizes + [max_size]


def bandwidths(size_bytes: int, time_us: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s) of an all-reduce of ``size_bytes`` bytes taking
    ``time_us`` microseconds among ``world_size`` ranks: nccl-tests' definitions."""
    algbw = size_bytes / (time_us * 1e3)
    busbw = algbw * 2 * (world_size - 1) / world_size if world_size > 1 else algbw
    return algbw, busbw


def check_sizes(sizes, dtype: str) -> tuple[int, ...]:
    """``sizes`` as a sorted tuple without repeats; a size that is not a whole number of
    ``dtype`` elements is a ``ConfigError``."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    width = ELEMENT_BYTES[dtype]
    for size in sizes:
        if size % width:
            raise ConfigError(f"size {format_size(size)} is not a whole number of {dtype} "
                              f"elements ({width} bytes each); give a multiple of {width}")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class Plan:
    backend: str
    """nccl (one GPU per process) or gloo (CPU processes)."""
    world_sizes: tuple[int, ...]
    """Processes of each launch, in order."""
    note: str = ""
    """How the world sizes were chosen when they were not given."""

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def plan_worlds(gpus: list[int] | None = None, procs: list[int] | None = None) -> Plan:
    """What to launch: ``gpus`` (NCCL, a process per GPU) or ``procs`` (gloo on the CPU), each
    a list of world sizes; neither: every visible GPU when CUDA is there, else 2 CPU
    processes. A request this machine cannot run is a ``ConfigError`` saying what to give."""
    import torch
    import torch.distributed as dist
    if gpus and procs:
        raise ConfigError("give --gpus (NCCL on GPUs) or --procs (gloo on the CPU), not both")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a torch build "
                          "with distributed support (the Linux wheels have it)")
    note = ""
    if not gpus and not procs:
        if torch.cuda.is_available():
            gpus = [torch.cuda.device_count()]
            note = (f"all {gpus[0]} visible GPUs" if gpus[0] > 1 else "the one visible GPU") \
                + " (--gpus N[,N...] to choose)"
        else:
            procs = [2]
            note = "no GPU here: 2 CPU processes over gloo (--procs N[,N...] to choose)"
    if gpus:
        if not torch.cuda.is_available():
            raise ConfigError("--gpus needs CUDA and torch sees no GPU here; use --procs N for "
                              "gloo on the CPU")
        visible = torch.cuda.device_count()
        if max(gpus) > visible:
            raise ConfigError(f"--gpus {max(gpus)}: only {visible} GPU{'s' * (visible != 1)} "
                              f"visible (torch.cuda.device_count()); give at most {visible}")
        if not dist.is_nccl_available():
            raise ConfigError("--gpus needs NCCL and this torch build has none; use --procs N "
                              "for gloo on the CPU")
        return Plan("nccl", tuple(dict.fromkeys(gpus)), note)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    if max(procs) > 4 * cores:
        raise ConfigError(f"--procs {max(procs)}: at most {4 * cores} (4 x the {cores} cores "
                          f"here)")
    if max(procs) > cores:
        warn_once(f"--procs {max(procs)} on {cores} cores: processes share cores, and the "
                  f"times include that sharing")
    return Plan("gloo", tuple(dict.fromkeys(procs)), note)


def run_allreduce_bench(cfg: AllReduceConfig, plan: Plan, out: Path, file=None) -> list[dict]:
    """Measure every world size of ``plan``, each in its own launch; append the records to
    ``out/results.jsonl`` (as each launch ends) and return them. A line per launch goes to
    ``file`` (stdout) as it starts. A worker that fails raises ``BenchFailed`` after the sizes
    measured before it are appended; its stderr is kept in ``out`` (the workers' stderr goes
    to files, their stdout, where NCCL_DEBUG writes, to the terminal)."""
    file = file or sys.stdout
    out = Path(out)
    sizes = check_sizes(cfg.sizes, cfg.dtype)
    records = []
    for n in plan.world_sizes:
        print(f"# all-reduce: {n} process{'es' * (n != 1)}, {plan.backend} on "
              f"{plan.device_type}, {cfg.dtype}, sizes {_span(sizes)}, {cfg.warmup} warm-up + "
              f"{cfg.reps} x {cfg.iters} timed per size", file=file, flush=True)
        with tempfile.TemporaryDirectory(prefix="kasoku-allreduce-") as tmp:
            request = dict(asdict(cfg), sizes=list(sizes), backend=plan.backend,
                           results=str(Path(tmp) / RESULTS_FILE))
            try:
                _launch(n, request, log_dir=Path(tmp) / "logs", keep_in=out)
            finally:  # what was measured before a failure is kept
                done = _read_lines(Path(request["results"]))
                _append(out / RESULTS_FILE, done)
                records += done
    return records


def _span(sizes) -> str:
    text = "..".join(dict.fromkeys((format_size(sizes[0]), format_size(sizes[-1]))))
    return text + (f" ({len(sizes)})" if len(sizes) > 2 else "")


def _launch(world_size: int, request: dict, log_dir: Path, keep_in: Path) -> None:
    """``python -m kasoku.dist.allreduce_bench REQUEST`` in ``world_size`` processes, through
    PyTorch's elastic launcher on this machine (torchrun --standalone's rendezvous). The
    workers' stderr goes to files in ``log_dir``; a failed worker's is copied to ``keep_in``
    and named in the ``BenchFailed`` raised."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    options = dict(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                   run_id=f"kasoku-allreduce-{uuid.uuid4().hex[:12]}", rdzv_backend="c10d",
                   rdzv_endpoint="localhost:0", rdzv_configs={"timeout": 120},
                   max_restarts=0,  # a benchmark retried after a failure measures nothing new
                   monitor_interval=0.1,
                   logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ERR))
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # not in older torch
        options["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    what = f"all-reduce with {world_size} process{'es' * (world_size != 1)}"
    try:
        with _launcher_side_effects_undone():
            elastic_launch(LaunchConfig(**options), sys.executable)(
                "-m", "kasoku.dist.allreduce_bench", json.dumps(request))
    except ChildFailedError as exc:
        rank, failure = _root_failure(exc.failures)
        message = failure.message
        if isinstance(message, dict):  # written by the worker's torch error recorder
            message = message.get("message", "")
        code = failure.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        cause = " ".join(str(message).split())[:400] if message and "errors.html" not in \
            str(message) else "no error recorded"
        kept = _keep_stderr(log_dir, failure.local_rank, keep_in / f"stderr-{world_size}procs-"
                            f"rank{rank}.log")
        raise BenchFailed(f"{what}: rank {rank} failed ({how}): {cause}"
                          + (f"; its stderr: {kept}" if kept else "")) from None
    except (KeyboardInterrupt, BenchFailed):
        raise
    except Exception as exc:  # the rendezvous itself, or the workers could not be started
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise BenchFailed(f"{what}: the workers could not start: {type(exc).__name__}: "
                          f"{text[:300]}") from None


def _root_failure(failures: dict) -> tuple:
    """``(rank, failure)`` of the worker that failed first: by its error file's time to the
    nanosecond (the launcher's own choice compares whole seconds, and the peers' "connection
    reset" errors land in the same second as the cause)."""
    def when(item):
        path = item[1].error_file
        return (os.stat(path).st_mtime_ns if os.path.isfile(path) else float("inf"),
                item[1].timestamp, item[0])
    return min(failures.items(), key=when)


def _keep_stderr(log_dir: Path, local_rank: int, to: Path) -> Path | None:
    """Copy worker ``local_rank``'s stderr file from the launcher's ``log_dir``
    (``RUN/attempt_N/RANK/stderr.log``) to ``to``; None when there is none."""
    found = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"))
    if not found:
        return None
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(found[-1], to)
    return to


@contextlib.contextmanager
def _launcher_side_effects_undone():
    """The elastic launcher installs signal handlers raising its ``SignalException`` (kept
    after it returns), sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` and logs its settings and each
    worker's exit: around one launch, the launcher's log is quieted, and afterwards the
    handlers and the variable are restored; a signal that stopped the launch becomes a
    ``KeyboardInterrupt`` carrying the exit code 128 + N."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {s: signal.getsignal(s) for s in (getattr(signal, n, None) for n in names)
             if s is not None}
    env_key = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    env_before = os.environ.get(env_key)
    # Each of the launcher's modules sets its own logger's level: quieting the parent alone
    # does nothing. kasoku says in one line what failed.
    logs = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
            if name.startswith("torch.distributed.elastic")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    except SignalException as exc:
        stop = KeyboardInterrupt(str(exc))
        stop.exit_code = 128 + int(exc.sigval)
        raise stop from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        if env_before is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = env_before


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _append(path: Path, records: list[dict]) -> None:
    if records:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


# --- in each worker process ------------------------------------------------------------------

def worker(request: dict) -> None:
    """Measure ``request["sizes"]`` in this process, one rank of a job the launcher's
    environment describes; rank 0 appends a record per size to ``request["results"]``."""
    import torch
    import torch.distributed as dist

    backend = request["backend"]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    group = {"timeout": dt.timedelta(seconds=request["timeout_s"])}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before the group: NCCL binds to this device
        device = torch.device("cuda", local_rank)
        group["device_id"] = device  # the communicator is made now, not in the first size
    else:
        device = torch.device("cpu")
        # One compute thread per process, as torchrun sets: idle OpenMP threads spinning
        # after the check's kernels would take cores from gloo's own threads.
        torch.set_num_threads(1)
    dist.init_process_group(backend, **group)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        if os.environ.get(FAIL_ENV, "").strip() == str(rank):
            raise RuntimeError(f"simulated failure of rank {rank} ({FAIL_ENV})")
        shared = _shared_fields(request, device, n) if rank == 0 else {}
        for size in request["sizes"]:
            times_us, wrong = measure_size(size, request, device, n)
            if rank == 0:
                _append(Path(request["results"]), [_record(shared, size, times_us, wrong, n)])
    except Exception as exc:
        # Recorded before the group closes: closing it fails the peers' collectives, and the
        # launcher names the error recorded first as the cause.
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        handler = get_error_handler()
        handler.initialize()
        handler.record_exception(exc)
        raise
    finally:
        dist.destroy_process_group()


def measure_size(size_bytes: int, request: dict, device, world_size: int):
    """``(times_us, wrong)``: per timed batch, the slowest rank's microseconds per
    all-reduce of ``size_bytes`` bytes; and the elements, over all ranks, that the check
    all-reduce got wrong. Every rank must call it with the same arguments."""
    import torch
    import torch.distributed as dist

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        request["dtype"]]
    buf = torch.ones(size_bytes // ELEMENT_BYTES[request["dtype"]], dtype=dtype, device=device)
    dist.all_reduce(buf)  # n ones summed: exact in every dtype for n <= 256
    wrong = (buf != world_size).sum().to(torch.float64)
    buf.zero_()
    for _ in range(request["warmup"]):
        dist.all_reduce(buf)
    times = torch.tensor([_timed_batch(buf, request["iters"]) / request["iters"]
                          for _ in range(request["reps"])], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
    dist.all_reduce(wrong)
    return times.tolist(), int(wrong.item())


def _timed_batch(buf, iters: int) -> float:
    """Microseconds of ``iters`` all-reduces of ``buf`` on this rank, started together."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    if buf.is_cuda:
        torch.cuda.synchronize()  # the barrier's own kernel is not timed
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(iters):
            dist.all_reduce(buf)  # the current stream waits for NCCL's: end follows the last
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) * 1e6


def _shared_fields(request: dict, device, world_size: int) -> dict:
    """What every record of this launch says besides its size's figures: the settings and
    where they were measured."""
    import torch
    from kasoku.perf.sysinfo import environment
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    nccl = None
    if request["backend"] == "nccl":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    algorithm = f"NCCL_ALGO={nccl_env['NCCL_ALGO']}" if request["backend"] == "nccl" and \
        nccl_env.get("NCCL_ALGO") else BACKEND_CHOICE
    env = environment(device)
    return {"schema": SCHEMA, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "world_size": world_size, "backend": request["backend"],
            "device_type": device.type, "device_name": env["device_name"],
            "dtype": request["dtype"], "algorithm": algorithm, "nccl_version": nccl,
            "nccl_env": nccl_env, "timing": "cuda events" if device.type == "cuda"
            else "perf_counter", "warmup": request["warmup"], "iters": request["iters"],
            "reps": request["reps"], "env": env}


def _record(shared: dict, size_bytes: int, times_us: list[float], wrong: int,
            world_size: int) -> dict:
    time_us = statistics.median(times_us)
    algbw, busbw = bandwidths(size_bytes, time_us, world_size)
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    figures = {"size_bytes": size_bytes, "count": size_bytes // ELEMENT_BYTES[shared["dtype"]],
               "time_us": time_us, "times_us": times_us, "algbw_gbps": algbw,
               "busbw_gbps": busbw, "wrong": wrong, "time": now}
    return {**{k: v for k, v in shared.items() if k != "env"}, **figures, "env": shared["env"]}


# --- the table and the chart ---------------------------------------------------------------

def print_results(records: list[dict], file=None) -> None:
    """The records as one table, a row per (world size, size), then the algorithm line."""
    from kasoku.report import print_table
    rows = [[str(r["world_size"]), r["backend"], r["dtype"], format_size(r["size_bytes"]),
             str(r["count"]), f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.3f}",
             f"{r['busbw_gbps']:.3f}", str(r["wrong"])]
            for r in sorted(records, key=lambda r: (r["world_size"], r["size_bytes"]))]
    print_table(["procs", "backend", "dtype", "size", "count", "time (us)", "algbw (GB/s)",
                 "busbw (GB/s)", "wrong"], rows,
                title="all-reduce (median over timed batches; busbw = algbw x 2(n-1)/n)",
                file=file)
    algorithms = ", ".join(dict.fromkeys(r["algorithm"] for r in records))
    hint = " (NCCL_ALGO to force one; NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING to see " \
        "NCCL's choice)" if any(r["backend"] == "nccl" for r in records) else ""
    print(f"algorithm: {algorithms}{hint}", file=file or sys.stdout)
    if any(r["world_size"] == 1 for r in records):
        print("1 process: an all-reduce among one rank moves no data; its time is the call's "
              "own cost", file=file or sys.stdout)


def plot_busbw(records: list[dict], path: Path) -> Path | None:
    """busbw against message size, a line per world size; None when nothing was measured.
    One process is left out beside others: it moves no data, and its "bandwidth" would
    flatten theirs."""
    shown = [r for r in records if r["world_size"] > 1] or records
    if not shown:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7.0, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, n in enumerate(sorted({r["world_size"] for r in shown})):
        mine = sorted((r for r in shown if r["world_size"] == n),
                      key=lambda r: r["size_bytes"])
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], "o-",
                color=f"C{i % 10}", label=f"{n} process{'es' * (n != 1)}")
    sizes = sorted({r["size_bytes"] for r in shown})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes], fontsize=7)
    ax.minorticks_off()
    first = shown[0]
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s), median of timed batches")
    ax.set_title(f"all-reduce bus bandwidth: {first['backend']}, {first['dtype']}, "
                 f"{first['device_name']}\nbusbw = algbw x 2(n-1)/n; algorithm: "
                 f"{first['algorithm']}" + ("; 1 process left out (it moves no data)"
                 if len(shown) < len(records) else ""), fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


def main(argv: list[str] | None = None) -> None:
    """A worker: ``python -m kasoku.dist.allreduce_bench REQUEST_JSON`` under the launcher."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m kasoku.dist.allreduce_bench REQUEST_JSON (started "
                         "by kasoku allreduce-bench, or torchrun)")
    worker(json.loads(argv[0]))


if __name__ == "__main__":
    main()
