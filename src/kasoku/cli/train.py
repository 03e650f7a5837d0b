"""``kasoku train``: argv -> ``DataConfig``, ``TrainConfig``, ``AccelConfig``, ``DistConfig``,
``KFACConfig`` -> one ``kasoku.run.RunConfig``, checked -> ``kasoku.commands.train.train_run``,
or the workers of a data-parallel run, each started with its JSON
(``kasoku.cli.train_worker``). The engine is imported where the command runs: the parser loads
no torch."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kasoku.cli import args as a
from kasoku.cli.accel import accel_config_from_args, add_accel_arguments
from kasoku.cli.distributed import add_dist_arguments, dist_config_from_args
from kasoku.core.errors import warn_once
from kasoku.core.flags import flag, without
from kasoku.data.config import DataConfig
from kasoku.data.registry import list_loaders, loader_kind
from kasoku.distributed import World
from kasoku.distributed.failures import note
from kasoku.distributed.launch import launch, under_launcher
from kasoku.kfac.config import (
    FACTOR_PRECISIONS,
    KFAC_BASES,
    KFAC_COMM_DTYPES,
    KFAC_METHODS,
    KFACConfig,
)
from kasoku.train.config import OPTIMIZERS, TrainConfig
from kasoku.train.run_dir import SnapshotError, default_out, find_snapshot
from kasoku.workloads import create_workload
from kasoku.workloads.registry import with_settings, workload_configs

if TYPE_CHECKING:
    from kasoku.run import RunConfig

WORKLOAD_HELP = ("a name from `kasoku list` (with a workload's settings: NAME:KEY=VALUE,..., "
                 "or their flags), or FILE.py:NAME for your own (a Workload subclass or a "
                 "function returning one; see examples/)")

TRAIN_FLAGS = {
    "device": {"type": a.device, "metavar": "{auto,cpu,cuda,cuda:N}", "default": "auto"},
    "epochs": None, "batch_size": None, "lr": None, "grad_clip": {"metavar": "NORM"},
    "optimizer": {"type": a.choice(OPTIMIZERS), "metavar": "{" + ",".join(OPTIMIZERS) + "}"},
    "seed": {"type": a.seed},
    "out": {"type": Path, "metavar": "DIR"},
    "overwrite": None,
    "log_interval": {"metavar": "ITERS"},
    "snapshot_interval": {"metavar": "ITERS"},
    "threads": {"type": a.threads},
    "progress": {"action": "store_false", "help": "no progress bar"},
}
LOADER_CORES_FLAG = {
    "action": "store_false",
    "help": "on a CPU, leave the loader's worker processes or threads on the cores of "
            "PyTorch's threads (by default each side is pinned to cores of its own: the "
            "workers one core each, at most a quarter of them, none below 4 cores; with "
            "--threads T the training step keeps T cores and the workers get the others). A "
            "loader with little to do, such as one over an in-memory dataset, leaves its "
            "cores idle: the step may be faster with all of them"}
DATA_FLAGS = {
    "root": {"type": Path, "metavar": "DIR"},
    "download": None, "synthetic": None,
    "synthetic_train_size": {"metavar": "N"},
    "cache": {"type": Path, "metavar": "DIR"},
    "strict": None,
}


KFAC_FLAGS = {
    "base": {"type": a.choice(KFAC_BASES), "metavar": "{" + ",".join(KFAC_BASES) + "}"},
    "method": {"type": a.choice(KFAC_METHODS), "metavar": "{" + ",".join(KFAC_METHODS) + "}"},
    "damping": None,
    "factor_decay": {"type": a.fraction},
    "kl_clip": None,
    "factor_update_freq": {"metavar": "STEPS"},
    "inv_update_freq": {"metavar": "STEPS"},
    "factor_precision": {"type": a.choice(FACTOR_PRECISIONS),
                         "metavar": "{" + ",".join(FACTOR_PRECISIONS) + "}"},
    "factor_comm_dtype": {"type": a.choice(KFAC_COMM_DTYPES),
                          "metavar": "{" + ",".join(KFAC_COMM_DTYPES) + "}"},
}


def kfac_config_from_args(args) -> KFACConfig | None:
    """The ``KFACConfig`` of the ``--kfac-*`` flags, or None when none was given."""
    if all(getattr(args, name, None) is None for name in KFAC_FLAGS):
        return None
    return a.config_from(args, KFACConfig)


def add_data_arguments(group) -> None:
    a.add_fields(group, DataConfig, DATA_FLAGS)


def add_workload_settings(parser) -> None:
    """A flag per field of each registered workload's settings (gpt's ``--model-size``), in
    a group of its own; fields with ``choices`` take only those."""
    for name, cls in workload_configs().items():
        choices = getattr(cls, "choices", {})
        a.add_fields(parser.add_argument_group(f"{name}'s settings (also {name}:KEY=VALUE,...)"),
                     cls, {f.name: {"type": a.choice(choices[f.name]),
                                    "metavar": "{" + ",".join(choices[f.name]) + "}"}
                           if f.name in choices else None for f in fields(cls)})


def workload_spec(args) -> str:
    """``args.workload`` with the settings its flags gave (``NAME:KEY=VALUE,...``)."""
    given = {f.name: getattr(args, f.name, None)
             for cls in workload_configs().values() for f in fields(cls)}
    return with_settings(args.workload, given)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a workload, with a Chainer-style log, snapshots "
                       "and plots", description="Train a workload. The run's log.jsonl, "
                       "snapshots and plots go to a new folder under runs/ (or --out DIR); a "
                       "folder holding another run is refused unless you --resume it or "
                       "--overwrite it.")
    p.add_argument("workload", help=WORKLOAD_HELP)
    a.add_fields(p, TrainConfig, TRAIN_FLAGS)
    p.add_argument("--resume", metavar="DIR|FILE|auto",
                   help="continue a run: its folder (its snapshot_latest.pt), a snapshot "
                   "file, or auto (the --out folder's snapshot when it has one, else a new "
                   "run there); the run goes on in the snapshot's folder unless --out says "
                   "otherwise")
    data = p.add_argument_group("data")
    add_data_arguments(data)
    add_workload_settings(p)
    kinds = [loader_kind(name) for name in list_loaders()]
    described = "; ".join(f"{k.name}[:N]: {k.help} (N: {k.count})" if k.count else
                          f"{k.name}: {k.help}" for k in kinds)
    a.add_fields(p.add_argument_group("loader"), TrainConfig, {
        "loader": {"type": a.loader_spec, "metavar": "KIND[:N]",
                   "help": f"which loader makes the batches (default: serial). {described}"
                   .replace("%", "%%")},
        "prefetch": {"metavar": "N"}, "loader_cores": LOADER_CORES_FLAG})
    a.add_fields(p.add_argument_group("K-FAC (--optimizer kfac)"), KFACConfig, KFAC_FLAGS)
    add_accel_arguments(p)
    add_dist_arguments(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from kasoku.commands.train import train_run  # deferred: torch (module doc)
    from kasoku.run import TrainRequest, resolve  # deferred: with the engine, when it runs
    dist = dist_config_from_args(args)
    data = a.config_from(args, DataConfig)
    run_cfg = resolve(create_workload(workload_spec(args)), data,
                      a.config_from(args, TrainConfig, **a.synthetic_loader(args, data)),
                      accel_config_from_args(args), dist, kfac_config_from_args(args))
    run_cfg.check()  # before the workers start: a mistake is said once
    if dist.numa_binding and not dist.asked and not under_launcher():
        warn_once(f"{flag('dist.numa_binding')} has no effect in one process: it binds the "
                  f"workers of {flag('dist.gpus')} N")
    if dist.shard and not dist.asked and not under_launcher():
        warn_once("--shard has no effect in one process: it shards over the workers of "
                  "--procs N or --gpus N")
    if dist.asked and not under_launcher():
        run_cfg, argv, out = _worker_run(run_cfg, args)
        request = TrainRequest(run_cfg, args.resume, tuple(argv))
        return launch([request.to_json()], dist, resume_command=_resume_command(args.argv, out),
                      out=out, module="kasoku.cli.train_worker")
    with says_how_to_continue(args.argv):
        train_run(run_cfg, args.resume)
    return 0


@contextlib.contextmanager
def says_how_to_continue(argv: list[str]):
    """Around training in this process (one worker of a data-parallel run under a launcher):
    a run a signal stopped after its snapshot says the command that continues it (``argv``:
    this command's words), or, in a worker whose note reached the launching process, ends
    quietly (exit 0: that process says where the run stopped and how to go on)."""
    from kasoku.train import TrainingInterrupted  # deferred: torch (module doc)
    try:
        yield
    except TrainingInterrupted as exc:
        if under_launcher() and note("interrupted", iteration=exc.iteration, signal=exc.signum,
                                     snapshot=str(exc.snapshot)):
            return
        if not under_launcher() or World.from_env().is_main:
            print(f"to continue this run: {_resume_command(argv, exc.snapshot.parent)}",
                  file=sys.stderr)
        raise


def _resume_command(argv: list[str], folder: Path | None) -> str | None:
    """The command line that continues this run from the snapshots in ``folder``."""
    if folder is None:
        return None
    return " ".join(["kasoku", *without(argv, {"--resume": 1}), "--resume", str(folder)])


def _worker_run(run_cfg: RunConfig, args) -> tuple[RunConfig, list[str], Path | None]:
    """The workers' run: this one, with the run folder fixed, so that every worker, and every
    restart of them, trains in the same one; the command's words with that folder; and the
    folder (None where it is not known here)."""
    argv, train = list(args.argv), run_cfg.train
    if train.out is not None:
        return run_cfg, argv, Path(train.out)
    if args.resume not in (None, "auto"):
        try:  # the run goes on in its snapshot's folder
            return run_cfg, argv, find_snapshot(args.resume).parent
        except SnapshotError:
            return run_cfg, argv, None  # the workers say what is wrong with --resume
    out = Path(default_out(create_workload(run_cfg.workload).name))
    return replace(run_cfg, train=replace(train, out=out)), argv + ["--out", str(out)], out


