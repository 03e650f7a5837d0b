"""``kasoku`` command line: a thin adapter from argv to configs and library calls."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kasoku.config import DataConfig, TrainConfig
from kasoku.errors import ConfigError, DataError
from kasoku.train.snapshot import SnapshotError


def _resolution(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"resolution must look like 500x375, got {text!r}")
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"resolution must be positive, got {text!r}")
    return w, h


PREFETCH_HELP = ("batches the loader keeps in flight: per worker for multiprocess and "
                 "gpu-jpeg-procs (default 2), in all for threads (2) and gpu-jpeg (3)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _loader_kind(text: str) -> str:
    from kasoku.run import _parse_loader
    try:
        _parse_loader(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a workload with a Chainer-style log")
    p.add_argument("workload", help="a name from `kasoku list`")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--epochs", type=float, help="epochs to train (default: the workload's recipe)")
    p.add_argument("--batch-size", type=int, help="samples per step (default: the recipe's)")
    p.add_argument("--lr", type=float, help="learning rate (default: the recipe's)")
    p.add_argument("--data", type=Path, help="folder holding the real dataset")
    p.add_argument("--download", action="store_true",
                   help="fetch the real dataset into --data from its official URL when missing")
    p.add_argument("--synthetic", action="store_true",
                   help="train on generated data of the real shapes (no files needed)")
    p.add_argument("--synthetic-size", type=int,
                   help="number of synthetic training samples (default: the workload's)")
    p.add_argument("--out", type=Path, default=Path("result"),
                   help="folder for log.jsonl, snapshots and plots (default: result)")
    p.add_argument("--resume", nargs="?", const="auto", metavar="PATH",
                   help="continue from a snapshot (default: OUT/snapshot_latest.pt)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, order, augmentation")
    p.add_argument("--log-interval", type=int, metavar="ITERS",
                   help="iterations between log lines (default: once per epoch)")
    p.add_argument("--snapshot-interval", type=int, metavar="ITERS",
                   help="iterations between snapshots (default: once per epoch)")
    p.add_argument("--loader", default="serial", type=_loader_kind,
                   metavar="{serial,device,threads[:N],multiprocess[:N],gpu-jpeg[:N],"
                           "gpu-jpeg-procs[:N]}",
                   help="serial: batches made in this process; device: the whole dataset "
                        "resident on --device (MNIST, CIFAR-10); threads[:N]: samples decoded "
                        "by N threads; multiprocess[:N]: batches made by N worker processes; "
                        "gpu-jpeg[:N]: JPEG folders read by N threads and decoded, cropped "
                        "and normalized in batches on the GPU (decoder: torchvision, else "
                        "nvImageCodec; KASOKU_GPU_JPEG_DECODER=torchvision|nvimgcodec|pillow "
                        "chooses); gpu-jpeg-procs[:N]: the same work in N worker processes "
                        "(default 8, at most half the cores), batches handed over in GPU memory")
    p.add_argument("--prefetch", type=_positive, metavar="N",
                   help=PREFETCH_HELP)
    p.add_argument("--strict-data", action="store_true",
                   help="make the first bad sample (corrupt image) an error instead of a "
                        "skipped, counted warning")
    p.add_argument("--threads", type=int,
                   help="CPU threads for PyTorch (default: one per core; 1 suits tiny models)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from kasoku.accel.cli_args import add_accel_arguments
    add_accel_arguments(p)


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="dataset tools")
    dsub = p.add_subparsers(dest="data_command", required=True)
    mk = dsub.add_parser("make-jpeg", help="write a synthetic ImageNet-style JPEG folder")
    mk.add_argument("out", type=Path, help="folder to create (root/class_XXX/img_XXXXXX.jpg)")
    mk.add_argument("--count", type=int, default=1000, help="number of images (default 1000)")
    mk.add_argument("--resolution", type=_resolution, default=(500, 375),
                    help="WIDTHxHEIGHT (default 500x375, ImageNet's typical size)")
    mk.add_argument("--classes", type=int, default=10, help="number of class folders")
    mk.add_argument("--quality", type=int, default=90, help="JPEG quality 1-95")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--workers", type=int,
                    help="processes writing the images (default: one per core)")
    dl = dsub.add_parser("download", help="fetch a dataset from its official URL (md5 checked)")
    dl.add_argument("dataset", choices=["mnist", "cifar10"])
    dl.add_argument("out", type=Path, help="folder to put the files in")
    _add_data_bench(dsub)


def _resolutions(text: str) -> list[tuple[int, int]]:
    return [_resolution(item) for item in text.split(",") if item.strip()]


def _add_data_bench(dsub) -> None:
    b = dsub.add_parser(
        "bench", help="can a loader keep up with a model? images/s, MB/s, CPU per loader",
        description="Run each loader alone (no model) on each SOURCE and report images/s, MB/s "
        "(the bytes of the files delivered per second: the page cache may serve them, as in "
        "seed 000's read bandwidth; in-memory datasets count their uint8 samples) and the CPU "
        "cores busy (this process and the loader's workers). With --model, also the model's "
        "training rate on synthetic on-device batches, the margin loader/model, and the rate "
        "of the model fed by each loader. Appends OUT/data_bench.jsonl, draws "
        "OUT/data_bench.png (images/s against loader processes).")
    b.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="an ImageNet-style image folder (ROOT/<class>/*.jpg, or ROOT/train/...)"
                   " or a workload name (its training data, see --data/--synthetic); with "
                   "--resolution, the folder to hold the generated folders (default OUT/jpeg)")
    b.add_argument("--loader", default="serial,threads:4,multiprocess:1,2,4",
                   metavar="SPEC[,SPEC...]",
                   help="loaders to measure, in order; a bare number continues the kind before "
                   "it: serial,multiprocess:1,2,4,8,threads:4 (default: %(default)s)")
    b.add_argument("--prefetch", type=_positive, metavar="N",
                   help=PREFETCH_HELP + "; the serial and device loaders are measured as they "
                   "are")
    b.add_argument("--resolution", type=_resolutions, metavar="WxH[,WxH...]",
                   help="measure synthetic JPEG folders of these resolutions (made once with "
                   "make-jpeg, reused after), e.g. 500x375,1000x750")
    b.add_argument("--images", type=int, default=2048,
                   help="images per generated folder (default 2048)")
    b.add_argument("--batch-size", type=int,
                   help="samples per batch (default: the --model's recipe, else 64)")
    b.add_argument("--image-size", type=int,
                   help="crop size of image folders (default: the --model's input, else 224)")
    b.add_argument("--warmup", type=int, default=3,
                   help="batches after the first, excluded from the windows (default 3)")
    b.add_argument("--batches", type=int, default=10, help="batches per window (default 10)")
    b.add_argument("--windows", type=int, default=3, help="timed windows (default 3)")
    b.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    b.add_argument("--model", metavar="WORKLOAD",
                   help="compare each loader with this workload's training rate")
    b.add_argument("--data", type=Path, help="folder holding a workload SOURCE's real data")
    b.add_argument("--synthetic", action="store_true",
                   help="workload SOURCEs use generated data of the real shapes")
    b.add_argument("--synthetic-size", type=int, help="synthetic training samples")
    b.add_argument("--seed", type=int, default=0, help="seed for order, crops and the model")
    b.add_argument("--out", type=Path, default=Path("runs/data-bench"),
                   help="folder for data_bench.jsonl, data_bench.png and generated JPEG "
                   "folders (default: runs/data-bench)")
    b.add_argument("--report", action="store_true",
                   help="measure nothing: print the table and redraw the chart from "
                   "OUT/data_bench.jsonl")
    from kasoku.accel.cli_args import add_accel_arguments
    add_accel_arguments(b)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kasoku", description="Measure, explain and accelerate deep-learning training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered workloads and their recipes")
    _add_train(sub)
    from kasoku.bench.cli_args import add_bench_parser
    add_bench_parser(sub)
    _add_data(sub)
    return parser


def _cmd_list(args) -> int:
    from kasoku.workloads import create_workload, list_workloads
    from kasoku.report import print_table
    rows = []
    for name in list_workloads():
        wl = create_workload(name)
        r = wl.recipe
        rows.append([name, wl.description, r.optimizer, f"{r.lr:g}", str(r.batch_size),
                     f"{r.epochs:g}"])
    print_table(["workload", "what", "optimizer", "lr", "batch", "epochs"], rows)
    return 0


def _cmd_train(args) -> int:
    from kasoku.run import train_workload
    data = DataConfig(root=args.data, synthetic=args.synthetic, download=args.download,
                      synthetic_train_size=args.synthetic_size, strict=args.strict_data)
    train = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                        seed=args.seed, device=args.device, out=args.out,
                        log_interval=args.log_interval, snapshot_interval=args.snapshot_interval,
                        loader=args.loader, prefetch=args.prefetch, threads=args.threads,
                        progress=not args.no_progress)
    resume = None
    if args.resume == "auto":
        resume = args.out / "snapshot_latest.pt"
    elif args.resume is not None:
        resume = Path(args.resume)
    from kasoku.train import TrainingInterrupted
    try:
        from kasoku.accel.cli_args import accel_config_from_args
        train_workload(args.workload, data, train, resume=resume,
                       accel=accel_config_from_args(args))
    except TrainingInterrupted as exc:
        command = " ".join(["kasoku", *_without_resume(args.argv), "--resume", str(exc.snapshot)])
        print(f"to continue this run: {command}", file=sys.stderr)
        raise
    return 0


def _without_resume(argv: list[str]) -> list[str]:
    kept, skip_value = [], False
    for token in argv:
        if skip_value and not token.startswith("-"):
            skip_value = False
            continue
        skip_value = token == "--resume"
        if not skip_value and not token.startswith("--resume="):
            kept.append(token)
    return kept


def _cmd_data(args) -> int:
    if args.data_command == "make-jpeg":
        from kasoku.data.jpeg_synth import make_jpeg_folder
        w, h = args.resolution
        stats = make_jpeg_folder(args.out, args.count, w, h, num_classes=args.classes,
                                 quality=args.quality, seed=args.seed, workers=args.workers)
        print(f"wrote {stats}")
        return 0
    if args.data_command == "download":
        from kasoku.data.download import fetch_dataset
        path = fetch_dataset(args.dataset, args.out)
        print(f"{args.dataset} is ready in {path}")
        return 0
    if args.data_command == "bench":
        return _cmd_data_bench(args)
    raise AssertionError(args.data_command)


def _cmd_data_bench(args) -> int:
    from kasoku.accel.cli_args import accel_config_from_args
    from kasoku.accel.config import AccelConfig
    from kasoku.bench import data_bench
    if args.report:
        from kasoku.bench.data_report import report_data_bench
        chart = report_data_bench(args.out)
        print(f"chart: {chart}" if chart else "nothing was measured: no chart")
        return 0
    accel = accel_config_from_args(args)
    if args.model is None and accel != AccelConfig():
        raise ConfigError("the acceleration flags set the --model's training step; give "
                          "--model WORKLOAD or drop them")
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    req = data_bench.DataBenchRequest(
        sources=tuple(args.sources), loaders=tuple(data_bench.expand_loaders(args.loader)),
        resolutions=tuple(args.resolution or ()), images=args.images, out=args.out,
        batch_size=args.batch_size, device=device, warmup=args.warmup, batches=args.batches,
        windows=args.windows, seed=args.seed, image_size=args.image_size,
        prefetch=args.prefetch,
        data=DataConfig(root=args.data, synthetic=args.synthetic,
                        synthetic_train_size=args.synthetic_size),
        model=args.model, accel=accel if args.model else None)
    return data_bench.run_data_bench(req).exit_code


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from kasoku.perf.queues import request_queues
    request_queues()  # before anything starts CUDA: side streams need queues of their own
    args = build_parser().parse_args(argv)
    args.argv = argv
    from kasoku.bench.cli_args import cmd_bench
    handlers = {"list": _cmd_list, "train": _cmd_train, "bench": cmd_bench, "data": _cmd_data}
    try:
        return handlers[args.command](args)
    except (DataError, ConfigError, SnapshotError) as exc:
        print(f"kasoku: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        code = getattr(exc, "exit_code", 130)
        return code


if __name__ == "__main__":
    sys.exit(main())
