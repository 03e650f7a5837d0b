"""The ``gpt`` workload on GPUs (issue 35): its CUDA paths checked, its ladder, its levers,
FSDP2 against DDP, and a training run. Every part runs kasoku's own commands (``kasoku train``,
``bench``, ``scale``) and keeps their output under OUT/PART; each bench has plain PyTorch
measured in the same run.

    PYTHONPATH=src python benchmarks/gpt_gpu.py check --out OUT     # tiny gpt, CUDA paths
    PYTHONPATH=src python benchmarks/gpt_gpu.py ladder --out OUT    # GPT-2 small, plain..+float8
    PYTHONPATH=src python benchmarks/gpt_gpu.py levers --out OUT    # checkpointing, float8, sdpa
    PYTHONPATH=src python benchmarks/gpt_gpu.py scale --out OUT     # DDP vs FSDP2, 1 and 2 GPUs
    PYTHONPATH=src python benchmarks/gpt_gpu.py train --minutes 9 --epochs 45 --out OUT \
        --run-dir runs/gpt-small     # again: the run resumes from its snapshot

check: ``kasoku train gpt --synthetic`` (tiny) once per combination of CUDA levers that had not
run on a GPU (the whole step as a CUDA graph with activation checkpointing, float8 with and
without the graph, pinned attention kernels); each run's exit code and last loss.
ladder: ``kasoku bench gpt --model-size small`` at batch 16 (x 1024 tokens), the transformer
ladder. levers: the top rung's neighbours as ``--config`` rungs: activation checkpointing
(selective, full: time and memory), float8 rowwise and without the graph, the attention's
kernel pinned (flash, efficient, math: the unfused reference). scale: ``kasoku scale`` of
GPT-2 small and medium on 1 and 2 GPUs, ``--shard`` (FSDP2) then DDP, the same rung.
train: ``kasoku train gpt --model-size small`` on the standard library's sources for
``--epochs``, ended by SIGTERM after ``--minutes`` (kasoku finishes the step and writes a
snapshot), its log kept; run again with the same ``--run-dir``, it resumes from that snapshot
(``--resume auto``), so a run longer than one sitting goes on in several. Only kasoku's
command line is run; nothing here imports kasoku.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

KASOKU = [sys.executable, "-m", "kasoku"]
SMALL = ["gpt", "--model-size", "small"]
BENCH = ["--batch-size", "16", "--steps", "10", "--windows", "3", "--warmup", "3",
         "--numerics-steps", "5"]
TOP = "precision=bf16,fused,compile"
"""The top rung without the graph: where checkpointing and float8 are compared."""


def run(cmd: list[str], log: Path, timeout: float | None = None) -> int:
    """Run ``cmd`` with its output appended to ``log``; past ``timeout`` seconds it gets
    SIGTERM (kasoku finishes its step, writes a snapshot and exits), then 60 s to end."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    print(f"  rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def last_loss(run_dir: Path) -> str:
    log = run_dir / "log.jsonl"
    if not log.is_file():
        return "-"
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    loss = [x["main/loss"] for x in lines if "main/loss" in x]
    return f"{loss[0]:.3f} -> {loss[-1]:.3f}" if loss else "-"


CHECKS = {
    "graph+ac-full": ["--precision", "bf16", "--optimizer-impl", "fused", "--cuda-graph",
                      "--activation-checkpointing", "full"],
    "compile+ac-selective": ["--precision", "bf16", "--compile", "--activation-checkpointing",
                             "selective"],
    "float8-rowwise+graph": ["--precision", "bf16", "--optimizer-impl", "fused", "--compile",
                             "--cuda-graph", "--float8", "rowwise"],
    "sdpa-flash": ["--precision", "bf16", "--sdpa-backend", "flash"],
    "fp32-sdpa-flash": ["--sdpa-backend", "flash"],  # flash has no fp32 kernel: refused?
}


def check(out: Path) -> None:
    rows = []
    for name, flags in CHECKS.items():
        d = out / name
        rc = run(KASOKU + ["train", "gpt", "--synthetic", "--epochs", "0.5", "--batch-size",
                           "16", "--no-progress", "--out", str(d), *flags], out / "check.log",
                 300)
        rows.append((name, rc, last_loss(d)))
    print("\ncheck (tiny gpt, synthetic, 64 steps):")
    for name, rc, loss in rows:
        print(f"  {name:24s} rc {rc:3d}  loss {loss}")


def ladder(out: Path) -> None:
    run(KASOKU + ["bench", *SMALL, *BENCH, "--out", str(out)], out / "bench.log")
    run(KASOKU + ["bench", *SMALL, "--report", "--out", str(out)], out / "report.log")
    print((out / "report.log").read_text()[-6000:])


LEVERS = [TOP, f"{TOP},activation_checkpointing=selective",
          f"{TOP},activation_checkpointing=full", f"{TOP},float8=tensorwise",
          f"{TOP},float8=rowwise", "precision=bf16,fused,sdpa_backend=flash",
          "precision=bf16,fused,sdpa_backend=efficient", "precision=bf16,fused,sdpa_backend=math"]


def levers(out: Path, which: list[str]) -> None:
    configs = [c for spec in which for c in ["--config", spec]]
    run(KASOKU + ["bench", *SMALL, *BENCH, *configs, "--out", str(out)], out / "bench.log")
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    print(f"\n{'rung':58s} {'tokens/s':>10s} {'ms/step':>8s} {'peak GiB':>8s} {'saved MB':>9s}")
    for r in records:
        f = r.get("figures") or r
        rate = f.get("samples_per_s", {})
        rate = rate.get("median") if isinstance(rate, dict) else rate
        step = (f.get("step_time_ms") or {}).get("median")
        mem = f.get("mem_peak_gib")
        saved = f.get("saved_activation_bytes")
        print(f"{r.get('rung', '?'):58s} {rate or 0:10,.0f} {step or 0:8.1f} "
              f"{mem or 0:8.2f} {(saved or 0) / 1e6:9.0f}  {r.get('error') or ''}"[:160])


def scale(out: Path, sizes: list[str], rung: str, batch: list[str]) -> None:
    for size in sizes:
        for shard in (["--shard"], []):  # FSDP2 first: the figure in question
            name = f"{size}-{'fsdp2' if shard else 'ddp'}"
            run(KASOKU + ["scale", "gpt", "--model-size", size, "--gpus", "1,2", "--config", rung,
                          *(["--batch-size", ",".join(batch)] if batch else []),
                          "--steps", "10", "--windows", "5", "--warmup", "5", *shard,
                          "--out", str(out / name)], out / f"{name}.log")
            print((out / f"{name}.log").read_text()[-2500:])


def train(out: Path, minutes: float, epochs: float, rung: list[str], run_dir: Path) -> None:
    """``epochs`` of the standard library's sources in ``run_dir`` (resumed from its snapshot
    when it has one), stopped by SIGTERM after ``minutes``."""
    run(KASOKU + ["train", *SMALL, "--epochs", str(epochs), "--no-progress",
                  "--log-interval", "200", "--out", str(run_dir), "--resume", "auto", *rung],
        out / "train.log", timeout=minutes * 60)
    print((out / "train.log").read_text()[-4000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["check", "ladder", "levers", "scale", "train"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", action="append", help="levers: the rungs (default: LEVERS)")
    p.add_argument("--sizes", default="small,medium", help="scale: model sizes")
    p.add_argument("--rung", default="precision=bf16,fused", help="scale: the step's levers")
    p.add_argument("--batch-size", default="", help="scale: batch sizes per GPU, N[,N...] "
                   "(default: the recipe's, 16 small, 8 medium)")
    p.add_argument("--minutes", type=float, default=8.0, help="train: the time budget")
    p.add_argument("--epochs", type=float, default=100.0,
                   help="train: the run's epochs (its learning-rate schedule spans them); "
                   "SIGTERM ends it after --minutes")
    p.add_argument("--run-dir", type=Path, help="train: the run's folder (default OUT/train/"
                   "run); a folder with a snapshot is resumed")
    p.add_argument("--train-flags", default="--precision bf16 --optimizer-impl fused "
                   "--compile --cuda-graph", help="train: the levers")
    args = p.parse_args()
    out = args.out / args.part
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.part == "check":
        check(out)
    elif args.part == "ladder":
        ladder(out)
    elif args.part == "levers":
        levers(out, args.config or LEVERS)
    elif args.part == "scale":
        scale(out, args.sizes.split(","), args.rung,
              [b for b in args.batch_size.split(",") if b])
    else:
        train(out, args.minutes, args.epochs, args.train_flags.split(),
              args.run_dir or out / "run")


if __name__ == "__main__":
    main()
