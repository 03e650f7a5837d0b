"""Does kasoku's advice hold? For each workload: ``kasoku profile`` (its levers tried, the best
one measured advised), then the advised lever timed again, independently: ``PAIRS``
alternating pairs of fresh ``kasoku profile --measure-only`` processes (the run as given, then
with the lever), medians. Each advice ends in one of: >= 1.05x (holds), within the noise,
slower; a verdict that advises no lever says so.

    python benchmarks/verdict_accuracy.py --device cpu --out runs/verdict-accuracy \\
        sine-lstm "cifar10-lenet5 --data ../shared/data/cifar10" \\
        "mnist-mlp --data ../shared/data/mnist" examples/stripes_cnn.py:StripesCNN
    python benchmarks/verdict_accuracy.py --device cuda --extra "--precision bf16 ..." ...

Each workload argument is the workload and any ``kasoku profile`` options for it, quoted
together; ``--extra`` is added to every run (the top rung's levers, say). Writes
``OUT/accuracy.jsonl`` (one line per workload: the verdict, what was tried, the re-timing)
and each profile's folder ``OUT/NAME``; prints the table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PAIRS = 3
HOLDS = 1.05


def kasoku(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kasoku", *argv], capture_output=True,
                          text=True, timeout=timeout)


def measure(argv: list[str]) -> float | None:
    done = kasoku("profile", *argv, "--measure-only")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["samples_per_s"]


def retime(base: list[str], lever: list[str], pairs: int = PAIRS) -> dict:
    """``pairs`` alternating pairs, as given then with the lever: the median ratio and its
    range over the pairs."""
    ratios, rates = [], []
    for _ in range(pairs):
        a, b = measure(base), measure(base + lever)
        if a and b:
            ratios.append(b / a)
            rates.append((a, b))
    if not ratios:
        return {"ratio": None, "result": "not measured"}
    ratio = statistics.median(ratios)
    low, high = min(ratios), max(ratios)
    if ratio >= HOLDS and low > 1.0:
        result = "holds"
    elif ratio < 1.0 and high < 1.0:
        result = "slower"
    else:
        result = "within the noise"
    return {"ratio": ratio, "low": low, "high": high, "pairs": rates, "result": result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="+", help="a workload and its profile options, quoted")
    p.add_argument("--device", default="cpu")
    p.add_argument("--extra", default="", help="options added to every run")
    p.add_argument("--out", type=Path, default=Path("runs/verdict-accuracy"))
    p.add_argument("--pairs", type=int, default=PAIRS, help="alternating pairs of the "
                   "re-timing (default %(default)s)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.workloads:
        words = shlex.split(spec) + ["--device", args.device] + shlex.split(args.extra)
        name = Path(words[0]).stem if words[0].endswith(".py") or ":" in words[0] else words[0]
        name = name.split(":")[0]
        out = args.out / name
        if (out / "profile.json").exists():  # this script's own folder, from an earlier run
            shutil.rmtree(out)
        print(f"{spec}: profiling ...", file=sys.stderr, flush=True)
        done = kasoku("profile", *words, "--out", str(out))
        if done.returncode != 0 or not (out / "profile.json").exists():
            err = (done.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"workload": spec, "error": err})
            print(f"  profile failed: {err}", file=sys.stderr)
            continue
        result = json.loads((out / "profile.json").read_text())
        verdict = result["verdict"]
        lever = list(verdict["lever"].get("args") or [])
        row = {"workload": spec, "device": args.device, "rule": verdict["rule"],
               "line": verdict["line"], "lever": lever, "tried": verdict.get("tried"),
               "samples_per_s": result["samples_per_s"]}
        if lever:
            print(f"  advised {' '.join(lever)}: timing it again ...", file=sys.stderr,
                  flush=True)
            row["retimed"] = retime(words, lever, args.pairs)
        rows.append(row)
        with open(args.out / "accuracy.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"{'workload':44s} {'verdict':28s} {'advised':26s} {'again':>6s}  result")
    for r in rows:
        if "error" in r:
            print(f"{r['workload'][:44]:44s} error: {r['error']}")
            continue
        again = r.get("retimed") or {}
        ratio = f"{again['ratio']:.2f}x" if again.get("ratio") else "-"
        print(f"{r['workload'][:44]:44s} {r['rule'][:28]:28s} {' '.join(r['lever'])[:26]:26s} "
              f"{ratio:>6s}  {again.get('result', 'no lever advised')}")
    advised = [r for r in rows if r.get("retimed")]
    holds = sum(r["retimed"]["result"] == "holds" for r in advised)
    slower = sum(r["retimed"]["result"] == "slower" for r in advised)
    print(f"advised levers: {len(advised)}; hold (>= {HOLDS}x): {holds}; slower: {slower}; "
          f"within the noise: {len(advised) - holds - slower}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
