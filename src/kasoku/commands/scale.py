"""``kasoku scale``: when data-parallel training pays, and why (seed 001 found two GPUs slower
than one for the small networks and faster for ResNet-152; seed 003 explains the all-reduce).

For each worker count N (``--gpus 1,2,4``: a process per GPU over NCCL; ``--procs 1,2``: CPU
processes over gloo), one launch of N workers through PyTorch's elastic launcher
(``kasoku.distributed.launch.run_module``). Each worker (``kasoku.commands.scale_worker``) trains on
synthetic batches already on its device, the per-worker batch fixed (weak scaling, as
data-parallel training is used), and times:

- the step **alone** (no DDP; all N workers run it at once, so they share the machine as in
  training but exchange nothing),
- the **data-parallel** step (DDP: the gradient buckets all-reduced during the backward
  pass),
- the **all-reduce alone**: the gradients' bytes in DDP's bucket sizes, nothing to overlap.

From those, per N:

    throughput          = N x batch / data-parallel step time
    scaling efficiency  = throughput / (N x the throughput of 1 worker alone)
    exposed all-reduce  = data-parallel step - step alone   (the all-reduce, and DDP's own
                          bookkeeping, not hidden behind the backward pass; with --data less
                          the longer wait for batches, counted apart)
    hidden              = all-reduce alone - exposed        (what the overlap saved)

and one line saying what limits the scaling: the exposed all-reduce, or workers that slow each
other down (on one CPU, N processes split its cores), or with ``--data`` steps waiting for the
loader's batches (``kasoku.commands.scale_feed``: each worker reads its shard of the dataset),
with what would help (no cause where a figure it rests on is unstable: ``scale_noise``). On
the CPU each worker gets cores / N threads (``--threads`` to set it), so the N workers never
ask for more cores than there are. The baseline of the efficiency is 1 worker alone: a single
process without DDP, what one would run without ``--gpus``.

``--shard``: the data-parallel step is FSDP2's (``fully_shard`` per block, then the whole
model; ``kasoku.distributed.fsdp``) and the communication alone its all-gathers and
reduce-scatters in its units' sizes; the rung must be one FSDP2 takes (no compile, no CUDA
graph: by default the highest such rung of the ladder). On CUDA the table adds each GPU's
peak memory, alone and data-parallel: what sharding saves.

Records: ``OUT/results.jsonl`` (schema ``kasoku.scale/1``, a line per N, appended as each
launch ends), a table, a summary line per N, and ``OUT/scale.png``.
"""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kasoku.accel.config import AccelConfig
from kasoku.commands.bench.results import carry_results
from kasoku.commands.bench.worker import config_from_dict
from kasoku.commands.scale_feed import DEFAULT_LOADER, data_cause
from kasoku.commands.scale_help import (
    bound_words,
    comm_of,
    exchange_help,
    latency_words,
    wrapper_of,
)
from kasoku.commands.scale_noise import efficiency_range, mark_chart, unstable_parts, withheld
from kasoku.commands.table import print_table
from kasoku.core.flags import flag
from kasoku.distributed.config import DistConfig
from kasoku.distributed.launch import WorkersFailed, run_module
from kasoku.distributed.plan import cpu_cores
from kasoku.perf.noise import marked
from kasoku.run import decode

RESULTS_FILE = "results.jsonl"
CHART_FILE = "scale.png"
EXPOSED_PCT = 15.0
"""An exposed all-reduce of at least this share of the step is named as the limit."""
SLOWDOWN = 1.15
"""Workers whose step alone takes at least this multiple of one worker's slow each other."""
GOOD_EFFICIENCY = 0.9


@dataclass(frozen=True)
class ScaleConfig:
    workload: str
    label: str
    """The rung measured: a ladder label or a ``--config`` spec."""
    config: dict
    """``Rung.config_dict()`` of the rung."""
    batch_size: int
    """Per worker."""
    steps: int = 20
    windows: int = 5
    warmup: int = 15
    seed: int = 0
    threads: int | None = None
    """CPU threads per worker (None: the machine's cores / N)."""
    bucket_mb: float = 25.0
    static_graph: bool = False
    allreduce_dtype: str = "fp32"
    timeout_s: float = 300.0
    data: str | None = None
    """The dataset folder each worker reads its shard of; None: synthetic batches on the
    device."""
    loader: str | None = None
    """The loader spec with ``data`` (None: ``kasoku train``'s default)."""
    shard: bool = False
    """FSDP2 (``fully_shard``) instead of DDP for the data-parallel step."""
    numa_binding: str | None = None
    """The launcher's NUMA binding of each GPU worker (``DistConfig.numa_binding``)."""


@dataclass(frozen=True)
class ScaleRequest:
    """What each worker of one launch is started with (``python -m
    kasoku.commands.scale_worker REQUEST``, ``to_json``): the measurement, the rung's levers
    (None: the plain loop) and the data-parallel settings, typed; the device type, the CPU
    threads per worker and the file rank 0 appends its record to."""
    scale: ScaleConfig
    accel: AccelConfig | None
    dist: DistConfig
    device_type: str
    threads: int
    results: Path

    def to_json(self) -> str:
        return json.dumps({"scale": asdict(self.scale),
                           "accel": None if self.accel is None else asdict(self.accel),
                           "dist": asdict(self.dist), "device_type": self.device_type,
                           "threads": self.threads, "results": str(self.results)})

    @classmethod
    def from_json(cls, text: str) -> ScaleRequest:
        data = json.loads(text)
        return cls(decode(ScaleConfig, data["scale"]),
                   None if data["accel"] is None else decode(AccelConfig, data["accel"]),
                   decode(DistConfig, data["dist"]), data["device_type"], data["threads"],
                   Path(data["results"]))


def run_scale(cfg: ScaleConfig, backend: str, world_sizes, out: Path, file=None) -> list[dict]:
    """Launch each world size in turn; append its record to ``out/results.jsonl`` as it ends
    and return them all. A failed launch raises ``WorkersFailed`` after the earlier records
    are kept."""
    file = file or sys.stdout
    out = Path(out)
    device_type = "cuda" if backend == "nccl" else "cpu"
    records = []
    for n in world_sizes:
        threads = cfg.threads or max(1, cpu_cores() // n)
        what = f"{cfg.workload} with {n} worker{'s' * (n != 1)}"
        source = (f"; each worker reads its shard of {cfg.data} through the "
                  f"{cfg.loader or DEFAULT_LOADER} loader" if cfg.data else "")
        print(f"# {what}: {backend} on {device_type}, {cfg.label}, batch {cfg.batch_size} per "
              f"worker (global {cfg.batch_size * n})"
              + (f", {threads} thread{'s' * (threads != 1)} each" if device_type == "cpu"
                 else "") + f"; {cfg.warmup} warm-up + {cfg.windows} x {cfg.steps} steps, "
              f"alone then data-parallel{source}", file=file, flush=True)
        with tempfile.TemporaryDirectory(prefix="kasoku-scale-") as tmp:
            dist = DistConfig(bucket_mb=cfg.bucket_mb, static_graph=cfg.static_graph,
                              allreduce_dtype=cfg.allreduce_dtype, shard=cfg.shard)
            request = ScaleRequest(cfg, config_from_dict(cfg.config), dist, device_type,
                                   threads, Path(tmp) / RESULTS_FILE)
            try:
                run_module("kasoku.commands.scale_worker", request.to_json(), n,
                           Path(tmp) / "logs", out, what, tag=f"{n}workers",
                           numa_binding=cfg.numa_binding)
            finally:
                records += carry_results(request.results, out)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per record (in worker-count order): speed-up and efficiency over 1 worker alone, the
    compute slowdown of the workers alone, and the explanation line. The baseline is the
    1-worker record's step alone; without one, the smallest worker count's step alone (said
    in ``baseline``)."""
    if not records:
        return []
    ordered = sorted(records, key=lambda r: r["world_size"])
    base = next((r for r in ordered if r["world_size"] == 1), ordered[0])
    base_rate = base["alone_samples_per_s_per_worker"]
    base_ms = base["alone_step_ms"]
    baseline = f"1 worker alone (no {wrapper_of(base)})" if base["world_size"] == 1 else \
        f"one of {base['world_size']} workers alone (no 1-worker run)"
    rows = []
    for r in ordered:
        n = r["world_size"]
        speedup = r["samples_per_s"] / base_rate
        row = {"world_size": n, "samples_per_s": r["samples_per_s"], "speedup": speedup,
               "efficiency": speedup / n, "slowdown": r["alone_step_ms"] / base_ms,
               "exposed_pct": r["exposed_allreduce_pct"], "baseline": baseline,
               "unstable": unstable_parts(r, base),
               "efficiency_range": efficiency_range(r, base, speedup / n)}
        row["explanation"] = explain(r, row)
        rows.append(row)
    return rows


def explain(r: dict, row: dict) -> str:
    """One line: what N workers give over one, and what limits it, with what would help."""
    n = r["world_size"]
    exposed, comm = r["exposed_allreduce_ms"], r["allreduce_alone_ms"]
    wrapper, what = wrapper_of(r), comm_of(r)
    # DDP's all-reduce overlaps the backward pass; FSDP2's all-gathers the forward too.
    behind = "the backward pass" if wrapper == "DDP" else "the compute"
    fed = data_cause(r)  # with --data: (share, words, what would help) when steps wait
    if n == 1:
        head = (f"{r['workload']}, 1 worker through {wrapper}: {row['speedup']:.2f}x the "
                f"throughput of one process without {wrapper}")
        if row.get("unstable"):
            return head + withheld(row)
        if row["exposed_pct"] >= EXPOSED_PCT:
            head += (f"; {wrapper}'s bookkeeping and its {what} among one worker take "
                     f"{row['exposed_pct']:.0f}% of each step ({exposed:.2f} ms of "
                     f"{r['step_ms']:.2f})")
        else:
            head += f"; {wrapper} costs little here"
        return head + (f"; {fed[1]}. Would help: {', '.join(fed[2])}" if fed else "")
    head = (f"{r['workload']}, {n} workers: {row['speedup']:.2f}x the throughput of 1 worker "
            f"alone ({row['efficiency']:.0%} scaling efficiency)")
    if row.get("unstable"):  # a cause drawn from noise would be a guess said as a finding
        return head + withheld(row)
    hidden = max(0.0, comm - exposed)
    causes, help_ = [], []
    if row["exposed_pct"] >= EXPOSED_PCT:
        text = (f"{row['exposed_pct']:.0f}% of each step ({exposed:.2f} ms of "
                f"{r['step_ms']:.2f}) is {what} not hidden behind {behind}")
        if exposed > 1.2 * comm:
            text += f", more than the {what} alone takes ({comm:.2f} ms): " + (
                "exchange and compute slow each other down on the shared cores"
                if r["device_type"] == "cpu" else
                f"the rest is {wrapper}'s own work or exchange and compute slowing each "
                f"other (kasoku profile WORKLOAD {flag('dist.gpus')} {n}"
                f"{' ' + flag('dist.shard') if wrapper == 'FSDP2' else ''} tells which)")
        else:
            text += (f" (the {what} alone takes {comm:.2f} ms{latency_words(r)}; "
                     f"{hidden:.2f} ms of it is hidden)")
        causes.append((row["exposed_pct"], text))
        help_ += exchange_help(r, wrapper, what)
    if row["slowdown"] >= SLOWDOWN:
        share = 100.0 * (r["alone_step_ms"] - r["alone_step_ms"] / row["slowdown"]) \
            / r["step_ms"]
        loaders = (r.get("data") or {}).get("loader_workers_per_worker") or 0
        why = (f"the {n} processes share this CPU's cores ({r['threads_per_worker']} "
               f"thread{'s' * (r['threads_per_worker'] != 1)}"
               + (f" and {loaders} loader worker{'s' * (loaders != 1)}" if loaders else "")
               + " each)"
               if r["device_type"] == "cpu" else "they share the host, its memory and links")
        causes.append((share, f"each worker's step alone takes {row['slowdown']:.2f}x one "
                              f"worker's: {why}"))
        if r["device_type"] == "cpu":
            help_.append("on one machine, one process with all the cores (processes pay off "
                         "across machines)")
    if fed:
        causes.append(fed[:2])
        help_.extend(fed[2])
    more = r.get("more_data_wait_ms") or 0.0
    if r["step_ms"] and 100.0 * more / r["step_ms"] >= EXPOSED_PCT:
        causes.append((100.0 * more / r["step_ms"],
                       f"each step waits {more:.2f} ms longer for its batch than the step "
                       f"alone: the {n} workers' loaders share the host"))
    if not causes:
        if row["efficiency"] >= GOOD_EFFICIENCY:
            return head + (f"; the {what} ({comm:.2f} ms alone) is hidden behind "
                           f"{behind} but for {exposed:.2f} ms")
        return head + "; no single cause stands out (see the step times)"
    causes.sort(key=lambda c: -c[0])
    return head + "; " + "; ".join(c for _, c in causes) + \
        (". Would help: " + ", ".join(help_) if help_ else "")


def print_results(records: list[dict], file=None) -> list[dict]:
    """The table (a row per worker count) and the explanation lines; returns the summary."""
    file = file or sys.stdout
    rows = summarize(records)
    by_n = {r["world_size"]: r for r in records}
    unit = records[0].get("unit", "samples") if records else "samples"
    data = (records[0].get("data") or {}) if records else {}
    fed = data.get("source") == "files"
    table = []
    for row in rows:
        r = by_n[row["world_size"]]
        table.append([str(row["world_size"]), str(r["global_batch_size"]),
                      marked(f"{row['samples_per_s']:,.0f}", r.get("stability")),
                      f"{row['speedup']:.2f}x" + "!" * bool(row["unstable"]),
                      f"{row['efficiency']:.0%}" + "!" * bool(row["unstable"]),
                      f"{r['step_ms']:.2f}",
                      f"{r['alone_step_ms']:.2f}", f"{r['exposed_allreduce_ms']:.2f}",
                      f"{row['exposed_pct']:.0f}%", f"{r['allreduce_alone_ms']:.2f}"]
                     + ([f"{r['data_wait_ms']:.2f}"] if fed else []))
    if rows:
        first = records[0]
        short = "all-reduce" if wrapper_of(first) == "DDP" else "gather/scatter"
        memory = first.get("peak_mem_mb") is not None
        if memory:  # CUDA: the peak memory per GPU, alone and data-parallel
            for cells, row in zip(table, rows):
                r = by_n[row["world_size"]]
                cells += [f"{r['alone_peak_mem_mb'] / 1e3:.1f}", f"{r['peak_mem_mb'] / 1e3:.1f}"]
        print_table(["workers", "global batch", f"{unit}/s", "speed-up", "efficiency",
                     "step (ms)", "alone (ms)", f"exposed {short} (ms)", "exposed %",
                     f"{short} alone (ms)"] + (["data wait (ms)"] if fed else [])
                    + (["peak GB alone", f"peak GB {wrapper_of(first)}"] if memory else []),
                    table,
                    title=f"scaling: {first['workload']}, {first['rung']}, "
                          f"{wrapper_of(first)} over {first['backend']}; speed-up over "
                          f"{rows[0]['baseline']}"
                          + (f"; data: {data['root']} through the {data['loader']} loader"
                             if fed else "") + bound_words(first),
                    file=file)
        for row in rows:
            print(row["explanation"], file=file)
        for r in records if fed else []:
            d = r["data"]
            print(f"data, {r['world_size']} worker{'s' * (r['world_size'] != 1)}: "
                  f"{d['train_samples']:,} training samples, a shard of "
                  f"{d['samples_per_worker']:,} per worker, {d['samples_read_per_worker']:,} "
                  f"read by each ({d['epochs_read']:.2f} of an epoch)"
                  + (f", {d['skipped_files']} bad files skipped" if d["skipped_files"] else ""),
                  file=file)
        for r in records:
            for key, what in (("stability", "data-parallel step"), ("alone_stability",
                                                                     "step alone")):
                reasons = (r.get(key) or {}).get("reasons")
                if reasons:
                    print(f"unstable (!): {r['world_size']} workers, the {what}: "
                          f"{'; '.join(reasons)}", file=file)
    return rows


def plot_scale(records: list[dict], path: Path) -> Path | None:
    """Left: throughput against workers, with the ideal (N x 1 worker alone). Right: each
    worker count's step time split into the step alone and the exposed all-reduce."""
    rows = summarize(records)
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    by_n = {r["world_size"]: r for r in records}
    ns = [row["world_size"] for row in rows]
    base = rows[0]["samples_per_s"] / rows[0]["speedup"]
    fig = Figure(figsize=(10.0, 4.2))
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2)
    ax.plot(ns, [row["samples_per_s"] for row in rows], "o-", color="C0", label="measured")
    ax.plot(ns, [n * base for n in ns], "--", color="0.5", label="ideal (N x 1 worker alone)")
    for i, row in enumerate(rows):
        last = i == len(rows) - 1 and len(rows) > 1  # inside the axes, left of its point
        ax.annotate(f"{row['efficiency']:.0%} efficiency"
                    + (" (unstable)" if row["unstable"] else ""), (row["world_size"],
                    row["samples_per_s"]), textcoords="offset points",
                    xytext=(-4 if last else 4, -12), ha="right" if last else "left",
                    fontsize=8)
    ax.set_xticks(ns)
    ax.set_xlabel("workers")
    ax.set_ylabel(f"{records[0].get('unit', 'samples')}/s (median window)")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput; %: efficiency = measured / ideal", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    alone = [by_n[n]["alone_step_ms"] for n in ns]
    exposed = [by_n[n]["exposed_allreduce_ms"] for n in ns]
    labels = [str(n) for n in ns]
    wrapper = wrapper_of(records[0])
    waits = [by_n[n].get("alone_data_wait_ms") for n in ns]
    if all(w is not None for w in waits):  # --data: the step alone's wait for its batches
        rest = [a - w for a, w in zip(alone, waits)]
        bars = [bx.bar(labels, rest, color="C0", label=f"step alone (no {wrapper}): the rest"),
                bx.bar(labels, waits, bottom=rest, color="C1",
                       label="step alone: waiting for data")]
    else:
        bars = [bx.bar(labels, alone, color="C0", label=f"step alone (no {wrapper})")]
    more = [by_n[n].get("more_data_wait_ms") or 0.0 for n in ns]
    if any(more):  # --data: the data-parallel step's longer wait for its batches
        bx.bar(labels, more, bottom=alone, color="C1", hatch="//", edgecolor="white",
               label="data-parallel: waiting longer for data")
    bars.append(bx.bar(labels, exposed, bottom=[a + m for a, m in zip(alone, more)],
                       color="C3", label="exposed all-reduce" if wrapper == "DDP"
                       else "exposed exchange + FSDP2's own work"))
    bx.set_ylim(0, 1.45 * max(a + m + e for a, m, e in zip(alone, more, exposed)))  # legend
    bx.set_xlabel("workers")
    bx.set_ylabel("ms per step")
    bx.grid(alpha=0.3, axis="y")
    bx.legend(fontsize=8)
    mark_chart(ax, bx, bars, rows)
    first = records[0]
    data = first.get("data") or {}
    fig.suptitle(f"{first['workload']} data-parallel: {first['rung']}, batch "
                 f"{first['batch_size_per_worker']} per worker, {first['backend']} on "
                 f"{first['env'].get('device_name', first['device_type'])}"
                 + (f"; {data['loader']} loader" if data.get("source") == "files" else ""),
                 fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    return path


__all__ = ["ScaleConfig", "WorkersFailed", "run_scale", "summarize", "explain",
           "print_results", "plot_scale"]
