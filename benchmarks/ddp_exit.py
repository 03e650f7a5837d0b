"""Does a data-parallel run with every lever exit on its own? ``RUNS`` consecutive runs of
``kasoku train`` (by default ImageNet ResNet-50 on every visible GPU, from a JPEG folder through
the GPU decoder, with every lever of the top rung), each in a fresh process group: its exit
code, its wall time, and the seconds between its last line and its exit (the teardown). A run
still alive ``--hang-s`` seconds after its last line is reported hung and killed, with its
workers.

    python benchmarks/ddp_exit.py --data JPEGS --runs 10 --out runs/ddp-exit

``--`` then any other ``kasoku train`` options replace the default levers. Writes
``OUT/exit.jsonl`` (one line per run) and prints the table. Before kasoku released the step's
CUDA graphs and compiled code ahead of ``destroy_process_group`` (``kasoku.accel.teardown``),
this command's runs on 2 H100s never exited.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LEVERS = ["--loader", "gpu-jpeg", "--batch-size", "256", "--epochs", "3", "--precision", "bf16",
          "--channels-last", "--cudnn-benchmark", "--compile", "--cuda-graph", "--fused-bn",
          "--fast-stem", "--matmul-1x1", "--wgrad-stream", "--optimizer-impl", "fused"]


def run_once(argv: list[str], hang_s: float, log: Path) -> dict:
    """One run: its exit code (None when hung), wall seconds, seconds from its last line to
    its exit."""
    start = time.perf_counter()
    last = [start]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kasoku", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def pump():
            for line in proc.stdout:
                last[0] = time.perf_counter()
                out.write(line)
                out.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while proc.poll() is None:
            if time.perf_counter() - last[0] > hang_s:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
                proc.wait()
                return {"exit": None, "wall_s": time.perf_counter() - start,
                        "after_last_line_s": time.perf_counter() - last[0], "hung": True}
            time.sleep(0.2)
        end = time.perf_counter()
        reader.join(timeout=5)
    return {"exit": proc.returncode, "wall_s": end - start,
            "after_last_line_s": end - last[0], "hung": False}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a JPEG folder (kasoku data make-jpeg)")
    p.add_argument("--workload", default="imagenet-resnet50")
    p.add_argument("--gpus", default=None, help="--gpus of the runs (default: all visible)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hang-s", type=float, default=120.0,
                   help="seconds without a line after which a run counts as hung")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run after this many seconds")
    p.add_argument("--out", type=Path, default=Path("runs/ddp-exit"))
    p.add_argument("levers", nargs=argparse.REMAINDER, help="-- then kasoku train options")
    args = p.parse_args()
    levers = [a for a in args.levers if a != "--"] or LEVERS
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = ["--gpus", args.gpus] if args.gpus else ["--gpus", str(_visible_gpus())]
    rows, began = [], time.perf_counter()
    for i in range(args.runs):
        if args.budget_s and time.perf_counter() - began > args.budget_s:
            print(f"budget of {args.budget_s:g} s spent after {i} runs", file=sys.stderr)
            break
        argv = ["train", args.workload, "--data", args.data, "--device", "cuda", *gpus,
                *levers, "--out", str(args.out / f"run{i}"), "--overwrite", "--no-progress"]
        row = {"run": i, **run_once(argv, args.hang_s, args.out / f"run{i}.log")}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out / "exit.jsonl", "a") as f:
            f.write(json.dumps({**row, "argv": argv}) + "\n")
    exited = sum(r["exit"] == 0 for r in rows)
    hung = sum(r["hung"] for r in rows)
    print(f"{len(rows)} runs: {exited} exited 0 on their own, {hung} hung, "
          f"{len(rows) - exited - hung} failed; teardown (last line to exit) "
          f"{', '.join(format(r['after_last_line_s'], '.1f') for r in rows)} s")
    return 0 if rows and exited == len(rows) else 1


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count()


if __name__ == "__main__":
    sys.exit(main())
