"""ResNet-50 training throughput in plain PyTorch (no kasoku): the configurations of
shared/BASELINES.md, to cross-check `kasoku bench imagenet-resnet50`'s rungs.

    python benchmarks/plain_resnet50.py --bs 32,256 --precision bf16 --channels-last --fused
    python benchmarks/plain_resnet50.py --bs 32 --no-cudnn-benchmark   # kasoku's plain rung
    python benchmarks/plain_resnet50.py --baselines --bs 32,256   # every row, fresh process each

Model: torchvision's resnet50 (v1.5). Optimizer: SGD, lr 0.1, momentum 0.9, weight decay 1e-4.
Data: a pool of 4 synthetic batches made on the device (float32 standard-normal images,
labels in [0, 1000)). Timing, as kasoku bench: warm-up steps (compilation, cuDNN autotuning
and graph capture fall there), then timed windows of steps, each between two CUDA events
followed by a synchronize (perf_counter on a CPU); the median over windows is reported, with
min and max. Prints one human line and one JSON line per (configuration, batch size).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

BASELINE_ROWS = [
    ("fp32, tf32 off", ["--precision", "fp32"]),
    ("tf32", ["--precision", "tf32"]),
    ("AMP fp16 + GradScaler, NCHW", ["--precision", "fp16"]),
    ("AMP bf16, NCHW", ["--precision", "bf16"]),
    ("AMP bf16, channels_last", ["--precision", "bf16", "--channels-last"]),
    ("+ fused SGD", ["--precision", "bf16", "--channels-last", "--fused"]),
    ("+ torch.compile (default mode)",
     ["--precision", "bf16", "--channels-last", "--fused", "--compile", "default"]),
    ("+ torch.compile mode=reduce-overhead",
     ["--precision", "bf16", "--channels-last", "--fused", "--compile", "reduce-overhead"]),
    ("whole step as one CUDA graph (eager)",
     ["--precision", "bf16", "--channels-last", "--fused", "--cuda-graph"]),
    ("whole step as one CUDA graph (compiled)",
     ["--precision", "bf16", "--channels-last", "--fused", "--compile", "default",
      "--cuda-graph"]),
]
AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resnet50():
    try:
        import torchvision
    except ImportError:
        sys.exit("plain_resnet50.py needs torchvision for its ResNet-50: pip install "
                 "torchvision (the build matching your torch)")
    return torchvision.models.resnet50()


def make_step(model, opt, args, device):
    """The training step a user writes for these flags: one function, no kasoku."""
    dtype = AUTOCAST.get(args.precision)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    forward = torch.compile(model, mode=args.compile) if args.compile else model

    def step(x, y):
        x = x.contiguous(memory_format=fmt)
        opt.zero_grad(set_to_none=not args.cuda_graph)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    if not args.cuda_graph:
        return step
    return capture_whole_step(step, opt, device)


def capture_whole_step(step, opt, device):
    """Capture forward, backward and the update as one CUDA graph (PyTorch's whole-network
    capture recipe): warm up on a side stream, capture once on static inputs, then each step
    copies its batch into them and replays."""
    state = {}

    def graphed(x, y):
        if "graph" not in state:
            static_x, static_y = x.clone(), y.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step(static_x, static_y)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                static_loss = step(static_x, static_y)
            state.update(graph=graph, x=static_x, y=static_y, loss=static_loss)
        state["x"].copy_(x)
        state["y"].copy_(y)
        state["graph"].replay()
        return state["loss"]

    return graphed


def timed(device, fn):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_one(args, bs: int) -> dict:
    device = torch.device(args.device)
    if args.cuda_graph and (device.type != "cuda" or args.precision == "fp16"):
        sys.exit("--cuda-graph needs CUDA and a precision without GradScaler (fp32, tf32, bf16)")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(0)
    model = resnet50().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4,
                          fused=True if args.fused else None)
    g = torch.Generator(device=device).manual_seed(0)
    pool = [(torch.randn(bs, 3, 224, 224, device=device, generator=g),
             torch.randint(0, 1000, (bs,), device=device, generator=g)) for _ in range(4)]
    step = make_step(model, opt, args, device)
    counter = iter(range(10 ** 9))

    def steps(n):
        for _ in range(n):
            x, y = pool[next(counter) % len(pool)]
            loss = step(x, y)
        return loss

    warmup_s = timed(device, lambda: steps(args.warmup))
    windows = [timed(device, lambda: steps(args.steps)) for _ in range(args.windows)]
    rates = [bs * args.steps / s for s in windows]
    return {"batch_size": bs, "precision": args.precision, "channels_last": args.channels_last,
            "fused": args.fused, "compile": args.compile, "cuda_graph": args.cuda_graph,
            "cudnn_benchmark": args.cudnn_benchmark, "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "torch": torch.__version__,
            "images_per_s": {"median": statistics.median(rates), "min": min(rates),
                             "max": max(rates), "n": len(rates)},
            "warmup_s": warmup_s, "steps_per_window": args.steps, "warmup_steps": args.warmup}


def run_baselines(args, sizes) -> int:
    """Every row of BASELINES.md at every batch size, each in a fresh process."""
    common = ["--device", args.device, "--steps", str(args.steps), "--windows",
              str(args.windows), "--warmup", str(args.warmup)]
    table = []
    for label, flags in BASELINE_ROWS:
        if "--cuda-graph" in flags and args.device == "cpu":
            continue
        cells = []
        for bs in sizes:
            cmd = [sys.executable, __file__, "--bs", str(bs), *flags, *common]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode == 0 and lines:
                cells.append(f"{json.loads(lines[-1])['images_per_s']['median']:,.0f}")
            else:
                err = (out.stderr.strip().splitlines() or ["?"])[-1]
                cells.append("OOM" if "out of memory" in err.lower() else "error")
                print(f"{label} bs {bs}: {err}", file=sys.stderr)
            print(f"{label:42s} bs {bs:4d}: {cells[-1]} img/s", flush=True)
        table.append((label, cells))
    print("\n| plain PyTorch configuration | " + " | ".join(f"bs {bs}" for bs in sizes) + " |")
    print("| --- | " + " | ".join("---:" for _ in sizes) + " |")
    for label, cells in table:
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", default="32,256", help="batch sizes, comma-separated")
    ap.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default="fp32",
                    help="fp32 (TF32 off), tf32, fp16 (autocast + GradScaler), bf16 (autocast)")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--fused", action="store_true", help="SGD(fused=True)")
    ap.add_argument("--compile", nargs="?", const="default", default=None,
                    help="torch.compile the model, optionally with a mode")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the whole step by hand as one CUDA graph")
    ap.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                    help="cuDNN autotuning off (kasoku's plain rung); on in BASELINES.md")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--baselines", action="store_true",
                    help="run every BASELINES.md row, each in a fresh process")
    args = ap.parse_args()
    sizes = [int(v) for v in args.bs.split(",")]
    if args.baselines:
        return run_baselines(args, sizes)
    for bs in sizes:
        r = run_one(args, bs)
        s = r["images_per_s"]
        print(f"bs {bs}: {s['median']:,.0f} img/s (min {s['min']:,.0f}, max {s['max']:,.0f}, "
              f"{s['n']} windows of {args.steps} steps; warm-up {r['warmup_s']:.1f} s)")
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
