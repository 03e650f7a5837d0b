"""The per-class verdict (each kernel class's distance to its measured limit) on one GPU, three
steps: GPT-2 small's top rung, ResNet-50's top rung (synthetic images on the device), and
nanoGPT's ``bench.py`` under ``kasoku profile -- python bench.py``.

    PYTHONPATH=src python benchmarks/roofline.py --nanogpt .peers/nanogpt --out OUT
        [--only gpt,resnet,nanogpt] [--batch 16] [--measure] [--extra FLAGS] [--tar FILE]

Each runs as ``kasoku profile ... --estimate`` (the verdict, its levers not measured) and
writes its ``profile.json``, ``report.html`` and ``roofline.png`` under OUT/NAME; this prints
each one's table and checks that its rows (the classes and the idle rest) add up to the step
within 5%. nanoGPT's files are fetched by hand into a git-ignored folder (``.peers/``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GPT = ["gpt:model_size=small,bias=no", "--synthetic", "--loader", "device", "--precision",
       "bf16", "--optimizer-impl", "fused", "--compile", "--cuda-graph"]
RESNET = ["imagenet-resnet50", "--batch-size", "256", "--synthetic", "--synthetic-size", "512",
          "--loader", "device", "--precision", "bf16", "--channels-last", "--cudnn-benchmark",
          "--optimizer-impl", "fused", "--compile", "--cuda-graph", "--fused-bn",
          "--fast-stem", "--combo-kernels", "--matmul-1x1", "--wgrad-stream"]


def commands(args) -> dict[str, list[str]]:
    kasoku = [sys.executable, "-m", "kasoku", "profile", "--device", "cuda"]
    if not args.measure:  # the verdict's levers measured (A/B runs) only when asked
        kasoku.append("--estimate")
    return {
        "gpt": kasoku + GPT + args.extra.split() + ["--batch-size", str(args.batch),
                               "--out", str(args.out / "gpt")],
        "resnet": kasoku + RESNET + ["--out", str(args.out / "resnet")],
        # run in nanoGPT's folder: bench.py reads its configurator.py from there
        "nanogpt": [sys.executable, "-m", "kasoku", "profile", "--estimate", "--skip", "3",
                    "--measure-steps", "8", "--warmup", "2", "--steps", "5",
                    "--out", str((args.out / "nanogpt").resolve()), "--", sys.executable,
                    "bench.py", "--real_data=False", f"--batch_size={args.batch}",
                    "--compile=True"],
    }


def check(name: str, out: Path) -> dict:
    found = sorted(out.rglob("profile.json"))
    if not found:
        return {"name": name, "error": "no profile.json"}
    result = json.loads(found[0].read_text())
    f = result["figures"]
    table = f.get("roofline")
    if not table:
        return {"name": name, "error": f.get("roofline_note", "no roofline")}
    busy = sum(r["ms"] for r in table["classes"])
    step = f["step_ms"]
    return {"name": name, "step_ms": step, "classes_ms": busy,
            "idle_ms": max(0.0, step - busy), "adds_up": abs(max(busy, step) - step) <= 0.05 * step,
            "gap_ms": table["gap_ms"], "gap_pct": 100 * table["gap_ms"] / step,
            "verdict": result["verdict"]["line"], "rows": table["classes"],
            "roofs": table["roofs"], "unprofiled_per_s": result.get("samples_per_s")
            or result.get("unprofiled", {}).get("samples_per_s")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nanogpt", type=Path, default=Path(".peers/nanogpt"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default="gpt,resnet,nanogpt")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--measure", action="store_true",
                   help="measure the verdict's levers of gpt and resnet (no --estimate)")
    p.add_argument("--extra", default="", help="more flags for gpt's profile (--fused-loss)")
    p.add_argument("--tar", type=Path, help="also pack OUT (less the traces) into this file")
    args = p.parse_args()
    runs = commands(args)
    summary = []
    for name in args.only.split(","):
        cmd = runs[name]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              cwd=args.nanogpt if name == "nanogpt" else None)
        (args.out / name).mkdir(parents=True, exist_ok=True)
        (args.out / name / "lines.txt").write_text(proc.stdout + proc.stderr)
        print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
        row = check(name, args.out / name)
        for work_trace in (args.out / name).rglob("work_trace.json"):  # kept, smaller
            subprocess.run(["gzip", "-f", str(work_trace)], check=True)
        row["exit"] = proc.returncode
        summary.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rows"}), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.tar:  # one file back from a machine that returns few
        subprocess.run(["tar", "czf", str(args.tar), "--exclude=*trace.json", "-C",
                        str(args.out), "."], check=True)


if __name__ == "__main__":
    main()
