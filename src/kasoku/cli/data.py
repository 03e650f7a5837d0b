"""``kasoku data``: make-jpeg, download, bench. Each imports its engine where it runs: the
parser loads no torch (nor numpy, PIL or urllib)."""
from __future__ import annotations

from pathlib import Path

from kasoku.accel.config import AccelConfig
from kasoku.cli import args as a
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.cli.train import add_data_arguments
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.data.registry import expand_loaders
from kasoku.train.config import TrainConfig
from kasoku.train.run_dir import OUTPUT_ROOT, make_out_dir


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="dataset tools: make-jpeg, download, bench")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="{make-jpeg,download,"
                            "bench}")
    mk = dsub.add_parser("make-jpeg", help="write a synthetic ImageNet-style JPEG folder",
                         description="Write --count photograph-like JPEGs as "
                         "OUT/class_XXX/img_XXXXXX.jpg, the layout `kasoku train "
                         "imagenet-resnet50 --data OUT` reads. A folder made by make-jpeg is "
                         "replaced; any other non-empty folder is refused.")
    mk.add_argument("--out", type=Path, required=True, metavar="DIR",
                    help="folder to create (required)")
    mk.add_argument("--count", type=a.positive_int, default=1000,
                    help="number of images (default 1000)")
    mk.add_argument("--resolution", type=a.resolution, default=(500, 375), metavar="WxH",
                    help="WIDTHxHEIGHT (default 500x375, ImageNet's typical size)")
    mk.add_argument("--classes", type=a.positive_int, default=10,
                    help="number of class folders (default 10)")
    mk.add_argument("--quality", type=_quality, default=90,
                    help="JPEG quality 1-100 (default 90, ImageNet-like)")
    mk.add_argument("--seed", type=a.seed, default=0, help="seed of the images (default 0)")
    mk.add_argument("--workers", type=a.positive_int,
                    help="processes writing the images (default: one per core)")
    mk.set_defaults(handler=_make_jpeg)
    dl = dsub.add_parser("download", help="fetch a dataset from its official URL (md5 checked)")
    dl.add_argument("dataset", choices=["mnist", "cifar10"], help="mnist or cifar10")
    dl.add_argument("--out", type=Path, required=True, metavar="DIR",
                    help="folder to put the files in (required); files already there with "
                    "the right md5 are kept")
    dl.set_defaults(handler=_download)
    _add_bench(dsub)


def _quality(text: str) -> int:
    value = a.positive_int(text)
    if value > 100:
        a._fail(f"must be a whole number from 1 to 100, got {text!r}")
    return value


def _add_bench(dsub) -> None:
    b = dsub.add_parser(
        "bench", help="can a loader keep up with a model? images/s, MB/s, CPU per loader",
        description="Run each loader alone (no model) on each SOURCE and report images/s, MB/s "
        "(the bytes of the files delivered per second: the page cache may serve them; "
        "in-memory datasets count their uint8 samples) and the CPU cores busy (this process "
        "and the loader's workers). With --model, also the model's training rate on synthetic "
        "on-device batches, the margin loader/model, and the rate of the model fed by each "
        "loader. Appends OUT/data_bench.jsonl, draws OUT/data_bench.png (images/s against "
        "loader processes).")
    b.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="an ImageNet-style image folder (ROOT/<class>/*.jpg, or ROOT/train/...)"
                   " or a workload name (its training data, see --data/--synthetic); with "
                   "--resolution, the folder to hold the generated folders (default OUT/jpeg)")
    b.add_argument("--loader", default="serial,threads:4,multiprocess:1,2,4",
                   type=_loader_list, metavar="SPEC[,SPEC...]",
                   help="loaders to measure, in order; a bare number continues the kind before "
                   "it: serial,multiprocess:1,2,4,8,threads:4 (default: "
                   "serial,threads:4,multiprocess:1,2,4)")
    b.add_argument("--prefetch", type=a.positive_int, metavar="N",
                   help=a.field_docs(TrainConfig)["prefetch"])
    b.add_argument("--resolution", type=a.resolutions, metavar="WxH[,WxH...]",
                   help="measure synthetic JPEG folders of these resolutions (made once with "
                   "make-jpeg, reused after), e.g. 500x375,1000x750")
    b.add_argument("--images", type=a.positive_int, default=2048,
                   help="images per generated folder (default 2048)")
    b.add_argument("--batch-size", type=a.int_list, metavar="N[,N...]",
                   help="batch sizes, each loader measured at each (default: the --model's "
                   "recipe, else 64)")
    b.add_argument("--image-size", type=_image_size,
                   help="crop size of image folders (default: the --model's input, else 224)")
    b.add_argument("--warmup", type=a.nonnegative_int, default=3,
                   help="batches after the first, excluded from the windows (default 3)")
    b.add_argument("--batches", type=a.positive_int, default=10,
                   help="batches per window (default 10)")
    b.add_argument("--windows", type=a.positive_int, default=3,
                   help="timed windows (default 3)")
    b.add_argument("--device", type=a.device, default="auto",
                   metavar="{auto,cpu,cuda,cuda:N}",
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N "
                   "(default: auto)")
    b.add_argument("--model", metavar="WORKLOAD",
                   help="compare each loader with this workload's training rate")
    add_data_arguments(b.add_argument_group("data of workload SOURCEs"))
    b.add_argument("--seed", type=a.seed, default=0,
                   help="seed for order, crops and the model (default 0)")
    b.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for data_bench.jsonl, data_bench.png and generated JPEG "
                   "folders; results are appended (default: runs/data-bench)")
    b.add_argument("--report", action="store_true",
                   help="measure nothing: print the table and redraw the chart from "
                   "OUT/data_bench.jsonl")
    add_accel_arguments(b)
    b.set_defaults(handler=_bench)


def _loader_list(text: str) -> list[str]:
    try:
        return expand_loaders(text)
    except ConfigError as exc:
        a._fail(str(exc))


def _image_size(text: str) -> int:
    value = a.positive_int(text)
    if not 8 <= value <= 4096:
        a._fail(f"must be from 8 to 4096 pixels, got {text!r}")
    return value


def _make_jpeg(args) -> int:
    from kasoku.data.jpeg_synth import make_jpeg_folder  # deferred: numpy, PIL (module doc)
    w, h = args.resolution
    stats = make_jpeg_folder(args.out, args.count, w, h, num_classes=args.classes,
                             quality=args.quality, seed=args.seed, workers=args.workers)
    print(f"wrote {stats['num_images']} images of {w}x{h} in {stats['num_classes']} classes "
          f"to {stats['out']} ({stats['total_bytes'] / 1e6:,.1f} MB, "
          f"{stats['elapsed_s']:.1f} s)")
    return 0


def _download(args) -> int:
    from kasoku.data.download import fetch_dataset  # deferred: urllib (module doc)
    path = fetch_dataset(args.dataset, make_out_dir(args.out, f"the {args.dataset} files"))
    print(f"{args.dataset} is ready in {path}")
    return 0


def _bench(args) -> int:
    from kasoku.commands.bench import data_bench  # deferred: torch (module doc)
    from kasoku.commands.bench.data_report import report_data_bench  # deferred: torch
    out = args.out or OUTPUT_ROOT / "data-bench"
    if args.report:
        chart = report_data_bench(out)
        print(f"chart: {chart}" if chart else "nothing was measured: no chart")
        return 0
    accel = accel_config_from_args(args)
    if args.model is None and accel != AccelConfig():
        raise ConfigError("the acceleration flags set the --model's training step; give "
                          "--model WORKLOAD or drop them")
    req = data_bench.DataBenchRequest(
        sources=tuple(args.sources), loaders=tuple(args.loader),
        resolutions=tuple(args.resolution or ()), images=args.images, out=out,
        batch_sizes=tuple(args.batch_size or ()), device=args.device, warmup=args.warmup,
        batches=args.batches, windows=args.windows, seed=args.seed,
        image_size=args.image_size, prefetch=args.prefetch,
        data=a.config_from(args, DataConfig), model=args.model,
        accel=accel if args.model else None)
    return data_bench.run_data_bench(req).exit_code
