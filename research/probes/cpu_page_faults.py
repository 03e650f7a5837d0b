"""Page faults per step of the MNIST MLP (batch 100, Adam fused) on a CPU, fp32 and bf16
autocast, with glibc's default malloc and with kasoku's keep_memory (mallopt: no heap
trimming, no mmap'd blocks). Each variant in a fresh process (the setting is process-wide);
prints faults per step and samples/s (median of the windows).

    python research/probes/cpu_page_faults.py [--windows 6] [--steps 30]
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(precision: str, keep: bool, windows: int, steps: int) -> dict:
    import torch
    from torch import nn
    if keep:
        from kasoku.accel.host_memory import apply_keep_memory
        assert apply_keep_memory("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000),
                          nn.ReLU(), nn.Linear(1000, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    xs = [torch.rand(100, 1, 28, 28) for _ in range(4)]
    ys = [torch.randint(0, 10, (100,)) for _ in range(4)]

    def step(i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = nn.functional.cross_entropy(model(xs[i % 4]), ys[i % 4])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(5):
        step(i)
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        rates.append(100 * steps / (time.perf_counter() - t0))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {"precision": precision, "keep_memory": keep, "threads": torch.get_num_threads(),
            "faults_per_step": faults / (windows * steps),
            "samples_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--one", nargs=2, metavar=("PRECISION", "KEEP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "1", args.windows, args.steps)))
        return
    for precision in ("fp32", "bf16"):
        for keep in ("0", "1"):
            out = subprocess.run([sys.executable, __file__, "--one", precision, keep,
                                  "--windows", str(args.windows), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{precision} keep_memory={r['keep_memory']!s:5}: "
                  f"{r['faults_per_step']:7.0f} faults/step, {r['samples_per_s']:9,.0f} "
                  f"samples/s (min {r['min']:,.0f}, max {r['max']:,.0f}), "
                  f"{r['threads']} threads", flush=True)


if __name__ == "__main__":
    main()
