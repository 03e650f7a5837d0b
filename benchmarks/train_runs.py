"""Train variants of one workload with ``kasoku train`` and compare them epoch by epoch: the
validation accuracy and elapsed time of every epoch, the first epoch at a target accuracy and
the training time to it, and the time per step (the median epoch after the first, which holds
the warm-up: cuDNN's autotuning, the first factor and inverse steps), and the rate end to end
(what the workers trained on per second, validation and snapshots included; the median of the
epochs after the first, per worker for ``--gpus N`` / ``--procs N``), with worker 0's wait
for its batches (the median ``time/data%`` of those epochs).

    python benchmarks/train_runs.py cifar10-resnet18 --target 0.9 --out runs/tta \\
        --common "--data ~/cifar10 --precision bf16 --channels-last --loader device" \\
        --run "sgd=--optimizer momentum --epochs 20" \\
        --run "kfac=--optimizer kfac --epochs 20 --kfac-factor-update-freq 10"

Each run is its own process (``python -m kasoku train``), one after the other; its log is the
run folder's ``log.jsonl``. A run stopped by ``--timeout`` is reported from the epochs it
finished. One JSON line per run goes to stdout and to ``OUT/results.jsonl``, then a table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kasoku.commands.bench.results import append_result, read_results

ACC = "validation/main/accuracy"
UNITS = ("images", "samples", "sequences", "tokens")
"""The log's count of what the workers trained on, summed over them (``LogReport``'s unit)."""


def workers_of(args: str) -> int:
    """How many data-parallel workers a run's ``kasoku train`` arguments start (``--gpus N`` or
    ``--procs N``; 1 without)."""
    words = shlex.split(args)
    for flag in ("--gpus", "--procs"):
        if flag in words[:-1]:
            return int(words[words.index(flag) + 1])
    return 1


def rates(epochs: list[dict]) -> list[float]:
    """Each epoch's rate end to end, units per second over all workers: what it trained on
    over its whole time, its validation pass and snapshot included (the log's elapsed time)."""
    unit = next((u for u in UNITS if epochs and u in epochs[0]), None)
    if unit is None:
        return []
    counts = [0, *(e[unit] for e in epochs)]
    elapsed = [0.0, *(e["elapsed_time"] for e in epochs)]
    return [(counts[k + 1] - counts[k]) / (elapsed[k + 1] - elapsed[k])
            for k in range(len(epochs)) if elapsed[k + 1] > elapsed[k]]


def summarize(name: str, log: list[dict], target: float | None, workers: int = 1) -> dict:
    """The per-epoch figures of one run's log entries (those with a validation accuracy);
    the rate end to end is the median of the epochs after the first (which holds the warm-up:
    compilation, autotuning, the graph capture), per worker as well for ``workers``."""
    epochs = [e for e in log if ACC in e]
    acc = [round(e[ACC], 4) for e in epochs]
    elapsed = [round(e["elapsed_time"], 2) for e in epochs]
    epoch_s = [b - a for a, b in zip([0.0, *elapsed], elapsed)]
    steps = [e["iteration"] for e in epochs]
    per_epoch = steps[0] if steps else None
    record = {"name": name, "epochs": len(epochs), "val_accuracy": acc, "elapsed_s": elapsed,
              "best_accuracy": max(acc) if acc else None,
              "final_accuracy": acc[-1] if acc else None,
              "first_epoch_s": round(epoch_s[0], 2) if epoch_s else None,
              "epoch_s_median": round(statistics.median(epoch_s[1:]), 2)
              if len(epoch_s) > 1 else None,
              "steps_per_epoch": per_epoch}
    if record["epoch_s_median"] and per_epoch:
        record["ms_per_step"] = round(1e3 * record["epoch_s_median"] / per_epoch, 2)
    waits = [e["time/data%"] for e in epochs[1:] if "time/data%" in e]
    if waits:  # worker 0's steps' wait for their batches (the always-on phase timers)
        record["data_wait_pct"] = round(statistics.median(waits), 1)
    after_first = rates(epochs)[1:]
    if after_first:
        record.update(workers=workers, rate_median=round(statistics.median(after_first), 1),
                      rate_min=round(min(after_first), 1), rate_max=round(max(after_first), 1),
                      rate_per_worker=round(statistics.median(after_first) / workers, 1))
    if target is not None:
        hit = next((i for i, a in enumerate(acc) if a >= target), None)
        record.update(target=target, epochs_to_target=None if hit is None else hit + 1,
                      seconds_to_target=None if hit is None else elapsed[hit])
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload")
    p.add_argument("--run", action="append", required=True, metavar="NAME=ARGS",
                   help="a variant: its name and its kasoku train arguments (repeatable)")
    p.add_argument("--common", default="", help="kasoku train arguments of every run")
    p.add_argument("--target", type=float, help="validation accuracy to time (0-1)")
    p.add_argument("--out", type=Path, required=True, help="folder for the runs' folders")
    p.add_argument("--timeout", type=float, help="seconds a run may take before it is stopped")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for spec in args.run:
        name, sep, extra = spec.partition("=")
        if not sep or not name:
            p.error(f"--run takes NAME=ARGS, got {spec!r}")
        folder = args.out / name
        cmd = [sys.executable, "-m", "kasoku", "train", args.workload,
               *shlex.split(args.common), *shlex.split(extra), "--out", str(folder),
               "--overwrite", "--no-progress"]
        print(f"== {name}: {shlex.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, output = "timeout", (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        wall = time.perf_counter() - start
        log_file = folder / "log.jsonl"
        log = read_results(log_file) if log_file.exists() else []
        record = {**summarize(name, log, args.target, workers_of(f"{args.common} {extra}")),
                  "exit": code,
                  "wall_s": round(wall, 1), "args": extra.strip()}
        if code != 0:
            record["output_tail"] = "\n".join(
                line for line in output.splitlines() if "USDT" not in line)[-1500:]
        records.append(record)
        print(json.dumps(record), flush=True)
        append_result(args.out, record)
    print(table(records))
    return 0


def table(records: list[dict]) -> str:
    rows = ["| run | epochs | best acc | final acc | epochs to target | s to target | "
            "s/epoch | ms/step | per second, end to end (min-max) | per worker | data wait |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        rate = (f"{r['rate_median']:,.0f} ({r['rate_min']:,.0f}-{r['rate_max']:,.0f})"
                if r.get("rate_median") else None)
        cells = [r["name"], r["epochs"], r["best_accuracy"], r["final_accuracy"],
                 r.get("epochs_to_target"), r.get("seconds_to_target"), r["epoch_s_median"],
                 r.get("ms_per_step"), rate,
                 f"{r['rate_per_worker']:,.0f}" if r.get("rate_per_worker") else None,
                 f"{r['data_wait_pct']:.1f}%" if r.get("data_wait_pct") is not None else None]
        rows.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
