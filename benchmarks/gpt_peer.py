"""GPT-2 small against nanoGPT on one GPU, in one call (issue 44): nanoGPT's own ``bench.py``
as its README runs it, then ``kasoku bench gpt --model-size small`` at the same batches with
kasoku's top rung, each in fresh processes, and the ratio of their tokens/s.

    PYTHONPATH=src python benchmarks/gpt_peer.py --nanogpt .peers/nanogpt --out OUT \\
        --batches 16,32 [--bias no,yes] [--config RUNG ...]

nanoGPT is karpathy/nanoGPT's ``model.py``, ``bench.py`` and ``configurator.py``, fetched and
kept in a git-ignored folder (``.peers/nanogpt``), never committed; it runs as
``bench.py --real_data=False --batch_size=B --compile=True`` (GPT-2 small without biases,
bf16 autocast, fused AdamW, torch.compile, synthetic tokens on the GPU; its time per iteration
is the mean of 20 steps after 10, each step ending in ``loss.item()``), tokens/s = B x 1,024 /
that time. kasoku's side is ``kasoku bench`` with ``--config TOP`` (the median of its windows,
numerics checked against fp32); ``gpt:bias=no`` is nanoGPT's model, ``yes`` GPT-2's.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

TOP = "precision=bf16,fused,compile,cuda_graph"
TOKENS = 1024


def nanogpt(folder: Path, batch: int) -> float | None:
    """nanoGPT's tokens/s at ``batch``: its ``bench.py`` as given (None: it failed)."""
    cmd = [sys.executable, "bench.py", "--real_data=False", f"--batch_size={batch}",
           "--compile=True"]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300)
    found = re.search(r"time per iteration: ([\d.]+)ms", proc.stdout)
    if found is None:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
        return None
    ms = float(found.group(1))
    print(f"nanoGPT bench.py b{batch}: {ms:.2f} ms/iteration", flush=True)
    return batch * TOKENS / ms * 1e3


def kasoku(batches: list[int], bias: str, configs: list[str], out: Path
           ) -> dict[tuple[str, int], dict]:
    """kasoku's rungs ``configs`` at each batch, one bench (each rung measured against the
    one before it): ``{(config, batch): its results.jsonl record}``."""
    folder = out / f"kasoku-bias-{bias}"
    cmd = [sys.executable, "-m", "kasoku", "bench", "gpt", "--model-size", "small", "--bias",
           bias, "--batch-size", ",".join(map(str, batches)),
           *[a for c in configs for a in ("--config", c)], "--steps", "10",
           "--windows", "5", "--warmup", "5", "--numerics-steps", "3", "--out", str(folder)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=False, timeout=900)
    records = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    return {(r["rung"], r["batch_size"]): r for r in records
            if r.get("rung") in configs and not r.get("error")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="nanoGPT's folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="16,32")
    p.add_argument("--bias", default="no", help="gpt's bias settings to measure: no,yes")
    p.add_argument("--config", action="append", help=f"kasoku's rungs (default: {TOP})")
    args = p.parse_args()
    configs = args.config or [TOP]
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    peer = {b: nanogpt(args.nanogpt, b) for b in batches}
    rows = []
    for bias in args.bias.split(","):
        for (config, b), rec in kasoku(batches, bias, configs, args.out).items():
            rate = rec["figures"]["samples_per_s"]
            ratio = rate["median"] / peer[b] if peer.get(b) else None
            rows.append({"bias": bias, "config": config, "batch": b,
                         "kasoku_tokens_per_s": rate["median"],
                         "window_range": [rate["min"], rate["max"]],
                         "mfu_measured_peak": rec["figures"].get("mfu"),
                         "nanogpt_tokens_per_s": peer.get(b), "ratio": ratio})
    with (args.out / "gpt_peer.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{'bias':5s} {'batch':>5s} {'kasoku tok/s':>14s} {'nanoGPT tok/s':>14s} {'ratio':>6s}"
          f"  rung")
    for r in rows:
        peer_rate = f"{r['nanogpt_tokens_per_s']:,.0f}" if r["nanogpt_tokens_per_s"] else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        print(f"{r['bias']:5s} {r['batch']:5d} {r['kasoku_tokens_per_s']:14,.0f} "
              f"{peer_rate:>14s} {ratio:>6s}  {r['config']}")


if __name__ == "__main__":
    main()
