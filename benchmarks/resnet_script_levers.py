"""Which levers from outside take the fp32 ResNet-50 script (benchmarks/scripts/
resnet_textbook.py, bs 64) past 3x its rate as given, on one GPU.

Each variant is ``kasoku run --with ...`` of the script (the as-given one without kasoku), in
rounds, in turn; each prints the script's own rate over its steps after ``--time-from`` (so
compilation, autotuning and the CUDA graphs' warm-up fall before), and the whole run's wall
time. ``--profile`` ends with ``kasoku profile --estimate`` of the first lever set given,
its ``kasoku:`` lines (where its step's time goes).

    PYTHONPATH=src python benchmarks/resnet_script_levers.py --rounds 2 \
        --variants given top top+cudnn --once max-autotune --profile top
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resnet_textbook.py"
TOP = ["bf16", "channels-last", "compile=reduce-overhead", "fused-optimizer"]
VARIANTS = {
    "given": None,
    "top": TOP,
    "top+cudnn": TOP + ["cudnn-benchmark"],
    "top+tf32": TOP + ["tf32"],
    "max-autotune": ["bf16", "channels-last", "compile=max-autotune", "fused-optimizer",
                     "cudnn-benchmark"],
    "top+cdt": TOP,
    "top+pointwise": TOP,
    "top+cdt+pointwise": TOP,
}
ENV = {
    "top+cdt": {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"},
    "top+pointwise": {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
    "top+cdt+pointwise": {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1",
                          "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
}
"""Inductor's own settings (its environment variables) beside a variant's levers."""


def command(levers: list[str] | None, steps: int, time_from: int) -> list[str]:
    script = [sys.executable, str(SCRIPT), "--steps", str(steps), "--time-from", str(time_from)]
    if levers is None:
        return script
    return [sys.executable, "-m", "kasoku", "run",
            *[w for v in levers for w in ("--with", v)], "--", *script]


def timed(name: str, cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **ENV.get(name, {})})
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"past {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"script"')]
    if proc.returncode or not lines:
        return {"variant": name, "error": proc.stderr[-2000:]}
    return {"variant": name, "samples_per_s": json.loads(lines[-1])["samples_per_s"],
            "wall_s": round(wall, 1),
            "kasoku": [ln for ln in proc.stderr.splitlines() if ln.startswith("kasoku:")][-3:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["given", "top"])
    ap.add_argument("--once", nargs="*", choices=sorted(VARIANTS), default=[],
                    help="variants run once, after the rounds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--time-from", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--profile", choices=sorted(VARIANTS), default=None)
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        for name in args.variants:
            rows.append(timed(name, command(VARIANTS[name], args.steps, args.time_from),
                              args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    for name in args.once:
        rows.append(timed(name, command(VARIANTS[name], args.steps, args.time_from),
                          args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    given = [r["samples_per_s"] for r in rows if r["variant"] == "given" and "samples_per_s" in r]
    for name in dict.fromkeys(args.variants + args.once):
        rates = [r["samples_per_s"] for r in rows if r["variant"] == name and "samples_per_s" in r]
        if rates and given:
            print(f"{name:14s} {statistics.median(rates):8.0f} samples/s "
                  f"({min(rates):.0f}-{max(rates):.0f}, n={len(rates)}) "
                  f"{statistics.median(rates) / statistics.median(given):.2f}x", flush=True)
    if args.profile:
        levers = VARIANTS[args.profile] or []
        cmd = [sys.executable, "-m", "kasoku", "profile", "--estimate", "--stop-after-window",
               *[w for v in levers for w in ("--with", v)], "--", sys.executable, str(SCRIPT),
               "--steps", "100000"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        print((proc.stdout + proc.stderr)[-6000:], flush=True)


if __name__ == "__main__":
    main()
