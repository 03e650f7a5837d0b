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
bandwidth whatever n is (one process moves no data: its time is the call's own cost, ~27 us for NCCL
on an H100 with torch 2.11). Timed buffers hold zeros, so repeated sums neither overflow nor go
denormal; one all-reduce of ones before the warm-up checks every element (``wrong``).

Which algorithm NCCL picks (Ring, Tree, NVLS, CollNet...) torch does not say: records name
``NCCL_ALGO`` when it is set (NCCL then uses it) and say "backend's choice" otherwise. To see
or steer the choice: ``NCCL_ALGO=Ring`` (or Tree, NVLS...) forces one, to compare;
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING`` makes NCCL print its topology and tuning
decisions (what they show depends on NCCL's version). Every ``NCCL_*`` variable set is
recorded (``nccl_env``).

Launching: ``run_allreduce_bench`` starts each world size with PyTorch's elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs; its settings from
``kasoku.distributed.launch.launch_config``, as ``kasoku train --gpus`` has them). The entrypoint is
a binary, ``python -m kasoku.commands.allreduce_worker REQUEST_JSON``, not a Python function: each
worker is a fresh interpreter that pickles nothing and re-imports no ``__main__`` (a function
entrypoint is spawned through multiprocessing, which re-runs the caller's main module and fails for
functions it cannot import by name), and the same command runs under ``torchrun`` or a scheduler, on
several machines, unchanged. Workers find their place in the launcher's environment
(``init_process_group`` from ``RANK``/``WORLD_SIZE``/``MASTER_*``; NCCL on GPU ``LOCAL_RANK``).
Rank 0 writes one JSON line per size to the request's ``results`` file as soon as it is measured;
the launching process appends them to ``OUT/results.jsonl`` (schema ``kasoku.allreduce_bench/1``),
prints the table and draws ``busbw.png``.
"""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kasoku.commands.bench.results import carry_results
from kasoku.commands.table import print_table
from kasoku.core.errors import ConfigError
from kasoku.distributed.launch import WorkersFailed, run_module
from kasoku.distributed.plan import Plan
from kasoku.perf.noise import marked

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


@dataclass(frozen=True)
class AllReduceRequest:
    """What each worker of one launch is started with (``python -m
    kasoku.commands.allreduce_worker REQUEST``, ``to_json``): the settings, the sizes checked,
    the backend, and the file rank 0 appends its records to."""
    config: AllReduceConfig
    backend: str
    results: Path

    def to_json(self) -> str:
        return json.dumps({"config": asdict(self.config), "backend": self.backend,
                           "results": str(self.results)})

    @classmethod
    def from_json(cls, text: str) -> AllReduceRequest:
        data = json.loads(text)
        config = dict(data["config"], sizes=tuple(data["config"]["sizes"]))
        return cls(AllReduceConfig(**config), data["backend"], Path(data["results"]))


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
            request = AllReduceRequest(replace(cfg, sizes=sizes), plan.backend,
                                       Path(tmp) / RESULTS_FILE)
            try:
                _launch(n, request, log_dir=Path(tmp) / "logs", keep_in=out)
            finally:  # what was measured before a failure is kept
                records += carry_results(request.results, out)
    return records


def _span(sizes) -> str:
    text = "..".join(dict.fromkeys((format_size(sizes[0]), format_size(sizes[-1]))))
    return text + (f" ({len(sizes)})" if len(sizes) > 2 else "")


def _launch(world_size: int, request: AllReduceRequest, log_dir: Path, keep_in: Path) -> None:
    """``python -m kasoku.commands.allreduce_worker REQUEST`` in ``world_size`` processes
    (``kasoku.distributed.launch.run_module``); a failure is a ``BenchFailed``."""
    what = f"all-reduce with {world_size} process{'es' * (world_size != 1)}"
    try:
        run_module("kasoku.commands.allreduce_worker", request.to_json(), world_size, log_dir,
                   keep_in, what, tag=f"{world_size}procs")
    except WorkersFailed as exc:
        raise BenchFailed(str(exc)) from None


# --- the table and the chart ---------------------------------------------------------------

def print_results(records: list[dict], file=None) -> None:
    """The records as one table, a row per (world size, size), then the algorithm line."""
    ordered = sorted(records, key=lambda r: (r["world_size"], r["size_bytes"]))
    rows = [[str(r["world_size"]), r["backend"], r["dtype"], format_size(r["size_bytes"]),
             str(r["count"]), marked(f"{r['time_us']:.1f}", r.get("stability")),
             f"{min(r['times_us']):.1f}-{max(r['times_us']):.1f}",
             f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", str(r["wrong"])]
            for r in ordered]
    print_table(["procs", "backend", "dtype", "size", "count", "time (us)", "min-max (us)",
                 "algbw (GB/s)", "busbw (GB/s)", "wrong"], rows,
                title="all-reduce (median over timed batches, ! unstable; busbw = algbw x "
                      "2(n-1)/n)", file=file)
    unstable = [f"{r['world_size']} procs, {format_size(r['size_bytes'])}" for r in ordered
                if not (r.get("stability") or {}).get("stable", True)]
    if unstable:
        print(f"unstable (!: the timed batches range over more than 10% of their median): "
              f"{', '.join(unstable)}", file=file or sys.stdout)
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
