"""``kasoku profile -- python SCRIPT.py`` on one GPU: a user's plain scripts
(``benchmarks/scripts/``), their verdicts and A/B runs, the equivalent kasoku workload beside,
and what kasoku around a script costs the steps after its window.

    PYTHONPATH=src python benchmarks/profile_script.py overhead --data .data/mnist --out OUT
    PYTHONPATH=src python benchmarks/profile_script.py mnist --data .data/mnist --out OUT
    PYTHONPATH=src python benchmarks/profile_script.py resnet --out OUT
    PYTHONPATH=src python benchmarks/profile_script.py bf16 --out OUT
    PYTHONPATH=src python benchmarks/profile_script.py auto --scripts resnet mnist \
        --data .data/mnist --out OUT

overhead: ``--pairs`` rounds, in turn, of the MNIST script alone and under ``kasoku profile
--estimate`` (its window ends at step 44; ``--arms`` adds runs that isolate a cause: no window,
CUPTI kept, kasoku's hardware queues), each printing the rate of its own steps 1000-6000; the
ratio per round and their median; and the cost per step of what kasoku leaves in the
script after its window (``residue_us``). mnist: the MNIST script's profile with its levers tried
and ``--confirm``, then ``kasoku profile mnist-mlp`` on the same files. resnet: the ResNet-50
script's. bf16: the ResNet-50 script's own rate (its steps 50-200) and first 10 losses,
``--rounds`` times in turn, as given, with bf16 autocast written into it (``--autocast``), and
under ``kasoku profile --estimate --with bf16`` (the lever from outside; the window ends before
step 50); then ``kasoku bench`` of kasoku's ResNet-50 at the same batch, rungs plain, fp32, tf32
and amp. auto: for each of ``--scripts``, the script as given (its own rate over its steps
after ``--time-from``, and its whole run's wall time), ``kasoku run --auto`` of it (its last
lines: the levers kept, their measured speed-up), then ``--pairs`` rounds, in turn, of the
script as given and ``kasoku run --with`` the kept levers. Each profile's ``profile.json`` and
kasoku's lines are copied to OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"


def run(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}\n")
    print("\n".join(line for line in proc.stderr.splitlines() if line.startswith("kasoku:")),
          flush=True)
    return proc


def rate(proc: subprocess.CompletedProcess) -> float:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"script"')][-1]
    return json.loads(line)["samples_per_s"]


ARMS = {
    "kasoku": ([], {}),
    # no window at all (the script ends first): the watch's patches and hooks alone
    "no-window": (["--skip", "100000"], {}),
    # the window, with CUPTI left attached after it as kineto does by default
    "cupti-kept": ([], {"TEARDOWN_CUPTI": "0"}),
    # the script alone with the hardware queues kasoku asks for its own runs
    "queues32": (None, {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
}
"""The runs beside the script alone in each round of ``overhead`` (``--arms``): kasoku's
extra arguments (None: the script alone) and environment."""


def overhead(args, out: Path, log: Path) -> dict:
    script = [sys.executable, str(SCRIPTS / "mnist_textbook.py"), "--data", str(args.data),
              "--steps", "6000", "--time-from", "1000"]
    rates = {"plain": [], **{arm: [] for arm in args.arms}}
    for i in range(args.pairs):
        rates["plain"].append(rate(run(script, log)))
        for arm in args.arms:
            extra, env = ARMS[arm]
            cmd = script if extra is None else [
                sys.executable, "-m", "kasoku", "profile", "--estimate", *extra,
                "--out", str(out / f"{arm}{i}"), "--", *script]
            rates[arm].append(rate(run(cmd, log, env)))
    ratios = {arm: [r / p for r, p in zip(rates[arm], rates["plain"])] for arm in args.arms}
    return {"figure": "overhead", "rates": rates, "ratios": ratios,
            "median_ratio": {arm: statistics.median(r) for arm, r in ratios.items()},
            "residue_us": residue_us()}


def residue_us(calls: int = 200_000) -> list[float]:
    """What kasoku leaves in a script after its window, per step: the optimizer post-hook,
    which stays (removing it while the optimizer runs would break its loop over hooks) and
    returns at once. Its cost per call, 5 timings of ``calls`` calls."""
    import timeit

    import torch

    from kasoku.commands.profile import ProfileConfig
    from kasoku.commands.script_watch import StepWatch
    watch = StepWatch(ProfileConfig(), Path("/tmp"))
    watch.done = True
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return [1e6 * t / calls for t in timeit.repeat(
        lambda: watch._optimizer_step(opt, (), {}), number=calls, repeat=5)]


def profile(name: str, cmd: list[str], out: Path, log: Path, work: Path) -> dict:
    folder = work / name
    proc = run([sys.executable, "-m", "kasoku", "profile", "--out", str(folder), *cmd], log)
    result = {"figure": name, "exit": proc.returncode}
    path = folder / "profile.json"
    if path.is_file():
        shutil.copy(path, out / f"{name}_profile.json")
        data = json.loads(path.read_text())
        result.update(verdict=data["verdict"]["line"], ladder=data.get("ladder"),
                      tried=data["verdict"].get("tried"))
    if (folder / "timeline.png").is_file():
        shutil.copy(folder / "timeline.png", out / f"{name}_timeline.png")
    return result


def losses(proc: subprocess.CompletedProcess) -> list[float]:
    return [float(ln.split()[2]) for ln in proc.stdout.splitlines() if ln.startswith("loss ")]


def bf16(args, out: Path, log: Path) -> dict:
    script = [sys.executable, str(SCRIPTS / "resnet_textbook.py"), "--print-losses", "10"]
    arms = {"as_given": script, "written": [*script, "--autocast"],
            "lever": [sys.executable, "-m", "kasoku", "profile", "--estimate", "--with", "bf16",
                      "--out", str(args.work / "bf16_lever"), "--", *script]}
    rates = {arm: [] for arm in arms}
    seen = {}
    for i in range(args.rounds):
        for arm, cmd in arms.items():
            shutil.rmtree(args.work / "bf16_lever", ignore_errors=True)
            proc = run(cmd, log)
            rates[arm].append(rate(proc))
            seen[arm] = losses(proc)
    diff = {arm: max(abs(a - b) / abs(b) for a, b in zip(seen[arm], seen["written"]))
            for arm in ("as_given", "lever")}
    ladder = out / "bench_bs64"
    subprocess.run([sys.executable, "-m", "kasoku", "bench", "imagenet-resnet50", "--device",
                    "cuda", "--batch-size", "64", "--config", "tf32", "--config", "amp",
                    "--out", str(ladder), "--timeout", "200"], check=False)
    rungs = {}
    if (ladder / "results.jsonl").is_file():
        for line in (ladder / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rungs[row["rung"]] = (row.get("figures") or {}).get("samples_per_s")
    return {"figure": "bf16", "rates": rates,
            "median": {arm: statistics.median(r) for arm, r in rates.items()},
            "over_as_given": {arm: statistics.median(r) / statistics.median(rates["as_given"])
                              for arm, r in rates.items()},
            "losses": seen, "max_rel_loss_diff_vs_written": diff, "ladder_bs64": rungs}


AUTO_SCRIPTS = {
    "resnet": lambda args: [str(SCRIPTS / "resnet_textbook.py"), "--steps", "600",
                            "--time-from", "100"],
    "mnist": lambda args: [str(SCRIPTS / "mnist_textbook.py"), "--data", str(args.data),
                           "--steps", "6000", "--time-from", "1000"],
}
"""``auto``'s scripts: long enough that compilation and warm-up fall before the timed steps."""


def kept_of(lines: list[str]) -> list[str]:
    """The ``--with`` values of ``kasoku run --auto``'s last line (``kept --with a --with b:
    measured ...``); none where it kept none."""
    last = [ln for ln in lines if ln.startswith("kasoku: kept ")]
    if not last:
        return []
    words = last[-1].removeprefix("kasoku: kept ").split(":")[0].split()
    return [w for w in words if w != "--with"]


def timed(cmd: list[str], log: Path) -> dict:
    t0 = time.perf_counter()
    proc = run(cmd, log)
    return {"samples_per_s": rate(proc), "wall_s": time.perf_counter() - t0,
            "kasoku": [ln for ln in proc.stderr.splitlines() if ln.startswith("kasoku:")]}


def auto(args, log: Path) -> list[dict]:
    figures = []
    for name in args.scripts:
        script = [sys.executable, *AUTO_SCRIPTS[name](args)]
        given = timed(script, log)
        chosen = timed([sys.executable, "-m", "kasoku", "run", "--auto", "--rounds",
                        str(args.rounds), "--", *script], log)
        kept = kept_of(chosen["kasoku"])
        with_kept = [sys.executable, "-m", "kasoku", "run",
                     *[w for v in kept for w in ("--with", v)], "--", *script]
        pairs = [(timed(script, log), timed(with_kept, log)) for _ in range(args.pairs)]
        ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in pairs]
        walls = [a["wall_s"] / b["wall_s"] for a, b in pairs]
        figures.append({"figure": f"auto_{name}", "script": script[1:], "given": given,
                        "auto": chosen, "kept": kept, "pairs": pairs,
                        "ratio_median": statistics.median(ratios) if ratios else None,
                        "ratios": ratios, "wall_ratios": walls})
        print(json.dumps(figures[-1]), flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["overhead", "mnist", "resnet", "bf16", "auto"], nargs="+")
    ap.add_argument("--rounds", type=int, default=3, help="bf16: the rounds of its three runs; "
                    "auto: kasoku run --auto's --rounds")
    ap.add_argument("--scripts", nargs="+", choices=sorted(AUTO_SCRIPTS), default=["resnet"],
                    help="auto: the scripts")
    ap.add_argument("--data", type=Path, default=Path(".data/mnist"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["kasoku"],
                    help="overhead: the runs beside the script alone in each round")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kasoku-profile-script"),
                    help="the profiles' folders (only their profile.json and timeline.png "
                    "are copied to --out)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    figures = []
    for what in args.what:
        if what == "overhead":
            figures.append(overhead(args, args.work, log))
        elif what == "mnist":
            script = ["python", str(SCRIPTS / "mnist_textbook.py"), "--data", str(args.data),
                      "--steps", "100000"]
            figures.append(profile("mnist_script", ["--confirm", "--stop-after-window", "--",
                                                     *script], args.out, log, args.work))
            figures.append(profile("mnist_workload", ["mnist-mlp", "--data", str(args.data),
                                                       "--confirm"], args.out, log, args.work))
        elif what == "bf16":
            figures.append(bf16(args, args.out, log))
        elif what == "auto":
            figures += auto(args, log)
        else:
            script = ["python", str(SCRIPTS / "resnet_textbook.py"), "--steps", "100000"]
            figures.append(profile("resnet_script", ["--confirm", "--stop-after-window", "--",
                                                      *script], args.out, log, args.work))
        print(json.dumps(figures[-1]), flush=True)
        (args.out / "summary.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
