"""The results store: one JSON line per measured run in ``OUT/results.jsonl`` (appended, never
rewritten), from which the table and the chart are made.

A line (schema ``kasoku.bench/1``)::

    schema, sweep_id, time (UTC ISO-8601), wall_s (the run's subprocess, start to exit)
    workload, rung, batch_size, unit ("images" or "samples": what samples_per_s counts),
    device, status ("ok" | "oom" | "error" | "timeout" | "skipped": a
    rung the ladder does not measure on this machine, ``error`` saying why),
    error (the error's last line, or null)
    config:   {"kind": "plain", ...} or {"kind": "kasoku", <every AccelConfig field>}
    settings: steps_per_window, windows, warmup_steps, numerics_steps, seed, pool_batches,
              optimizer, lr, momentum, weight_decay; cpu_threads (CPU runs: threads,
              interop_threads, pinned_cpus, as ``kasoku.accel.cpu_threads`` set them; on
              the loader rung with worker processes or threads also loader_workers,
              loader_cpus, loader_note and affinity_cpus (the mask split), with threads and
              pinned_cpus the step's side, as ``kasoku.accel.loader_cores`` split the cores:
              loader_cpus null and loader_note saying why where they share them)
    data:     source ("synthetic on-device", or "SPEC loader, DIR" for the loader rung),
              input_shape, input_dtype, input_range, target; the loader rung also loader
              (the spec), root, train_samples
    env:      kasoku_version, kasoku_git, python, torch, cuda, cudnn, driver, device_type,
              device_name, device_count, compute_capability (CUDA), cpu_name, cpu_count,
              cpu_affinity, torch_threads, torch_interop_threads, platform, cpu
              (``kasoku.perf.cpuinfo.CpuInfo.to_dict()``)
    figures:  samples_per_s {median, min, max, n}, step_time_ms {median, min, max},
              steps_per_window, warmup_s, first_step_s, final_loss, mem_peak_gib,
              mem_peak_kind, model_flops_per_step, flops_method, compute_dtype,
              peak_flops_per_s, peak (the probe's record; on a CPU with ``theory``, the
              first-principles peak), mfu, mfu_note; on a CPU mfu_theory, mfu_theory_note
              (MFU against the first-principles peak); saved_activation_bytes (a model
              with blocks: what one forward keeps for its backward pass, the memory
              activation checkpointing saves, ``kasoku.perf.activations``);
              kernels (with --kernels); profile: the figures of the run's profiled window
              (``kasoku.perf.profile.trace.analyse``: device, step_ms, data_pct, busy_pct
              and idle_*_pct on a GPU, operator_pct on a CPU, by_kind_ms, top 5 kernels
              and operators...; step shares restated for the unprofiled step, the
              profiled ones under ``profiled``), or {"error": its last line}
    verdict:  (ok runs with a profile) the bottleneck verdict of
              ``kasoku.advisor.verdict``: rule, reason, line, lever {text, expect, args,
              speedup}, experiments, secondary; or {"error": ...} when it could not be judged
    numerics: status ("ok" | "FAIL" | "n/a"), losses (the first K), loss (step K),
              mean_loss, reference_mean_loss, rel_diff, tolerance, steps, reason
    notes:    levers skipped or adjusted on this device, and why
    log:      (failed runs only) the file holding the run's whole stderr

mem_peak_gib is torch.cuda.max_memory_allocated over the whole run on a GPU (the pool of
synthetic batches included), the process's peak resident memory on a CPU (mem_peak_kind).

Figures a run did not reach are absent or null (an OOM has no samples_per_s).
"""
from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "kasoku.bench/1"
RESULTS_FILE = "results.jsonl"


def append_result(out: Path, record: dict, filename: str = RESULTS_FILE) -> None:
    """Append one line to ``out/filename``; the folder is created on first use."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / filename, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=False) + "\n")


def read_results(path: Path, sweep_id: str | None = None) -> list[dict]:
    """Every line of ``path`` (a results.jsonl or the folder holding it), optionally only one
    sweep's."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if sweep_id is None or record.get("sweep_id") == sweep_id:
                    records.append(record)
    return records


def carry_results(path: Path, out: Path) -> list[dict]:
    """The lines of ``path`` (none when it does not exist), appended to
    ``out/results.jsonl``: what worker processes wrote to a temporary file, kept."""
    records = read_results(path) if Path(path).is_file() else []
    for record in records:
        append_result(out, record)
    return records


def median_rate(record: dict) -> float | None:
    """Median samples/s of an ``ok`` run, else None."""
    if record.get("status") != "ok":
        return None
    return (record.get("figures", {}).get("samples_per_s") or {}).get("median")
