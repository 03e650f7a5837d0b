"""The data-parallel options shared by ``kasoku train`` (and the commands that train):
argv -> ``DistConfig``, and the decision to start the workers."""
from __future__ import annotations

from kasoku.cli import args as a
from kasoku.distributed.config import ALLREDUCE_DTYPES, NUMA_BINDINGS, DistConfig

DIST_FLAGS = {
    "gpus": {"metavar": "N"},
    "procs": {"metavar": "N"},
    "nnodes": {"metavar": "N"},
    "node_rank": {"type": a.nonnegative_int, "metavar": "R"},
    "rdzv_endpoint": {"metavar": "HOST:PORT"},
    "max_restarts": {"type": a.nonnegative_int, "metavar": "N"},
    "dist_timeout": {"metavar": "SECONDS"},
    "bucket_mb": {"metavar": "MB"},
    "static_graph": None,
    "allreduce_dtype": {"choices": ALLREDUCE_DTYPES},
    "sync_bn": None,
    "shard": None,
    "numa_binding": {"choices": NUMA_BINDINGS},
    "scale_lr": None,
}


def add_dist_arguments(parser) -> None:
    group = parser.add_argument_group(
        "data-parallel", "several workers, each with the whole model and a shard of every "
        "batch (PyTorch's DistributedDataParallel; with --shard, 1/N of the model each: FSDP2); "
        "--batch-size is per worker")
    a.add_fields(group, DistConfig, DIST_FLAGS)


def dist_config_from_args(args) -> DistConfig:
    cfg = a.config_from(args, DistConfig)
    cfg.check()
    return cfg
