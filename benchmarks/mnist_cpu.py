"""kasoku's trainer vs the textbook plain-PyTorch loop, MNIST MLP on this machine's CPU.

Each run is a fresh process; the variants alternate so drifts in machine load hit all of them.
Per-epoch time = training + validation pass (both loops validate every epoch). Reports the
median over runs of the per-epoch median, and the validation accuracy after each epoch.

    python benchmarks/mnist_cpu.py --data ../shared/data/mnist --epochs 2 --runs 3
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def plain(data: Path, epochs: int, fused: bool) -> list[dict]:
    cmd = [sys.executable, str(HERE / "plain_mnist_loop.py"), "--data", str(data),
           "--epochs", str(epochs)] + (["--fused"] if fused else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def kasoku(data: Path, epochs: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kasoku", "train", "mnist-mlp", "--data", str(data),
               "--epochs", str(epochs), "--out", tmp, "--no-progress"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        log = [json.loads(line) for line in open(Path(tmp) / "log.jsonl")]
    rows, prev = [], 0.0
    for entry in log:
        rows.append({"epoch": entry["epoch"], "epoch_time_s": entry["elapsed_time"] - prev,
                     "val_accuracy": entry["validation/main/accuracy"]})
        prev = entry["elapsed_time"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    variants = {"plain PyTorch (textbook DataLoader loop, Adam)":
                lambda: plain(args.data, args.epochs, False),
                "plain PyTorch + Adam(fused=True)": lambda: plain(args.data, args.epochs, True),
                "kasoku train mnist-mlp": lambda: kasoku(args.data, args.epochs)}
    results = {name: [] for name in variants}
    for run in range(args.runs):
        for name, fn in variants.items():
            rows = fn()
            results[name].append(rows)
            print(f"run {run + 1} {name}: " + ", ".join(
                f"{r['epoch_time_s']:.2f}s/{r['val_accuracy']:.4f}" for r in rows), flush=True)
    import torch
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'variant':50s} {'s/epoch (median)':>17s} {'min':>6s} {'max':>6s}  val acc by epoch")
    for name, runs in results.items():
        per_run = [statistics.median(r["epoch_time_s"] for r in rows) for rows in runs]
        accs = " ".join(f"{statistics.median(rows[e]['val_accuracy'] for rows in runs):.4f}"
                        for e in range(args.epochs))
        print(f"{name:50s} {statistics.median(per_run):17.2f} {min(per_run):6.2f} "
              f"{max(per_run):6.2f}  {accs}")


if __name__ == "__main__":
    main()
