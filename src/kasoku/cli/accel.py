"""The lever flags, shared by ``kasoku train``, ``bench`` (through ``--config``) and ``data
bench --model``: one flag per ``AccelConfig`` field, its help the field's docstring."""
from __future__ import annotations

import argparse
from typing import get_args

from kasoku.accel.config import (
    CHECKPOINTING_MODES,
    COMPILE_MODES,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    SDPA_BACKENDS,
    AccelConfig,
    Float8,
)
from kasoku.cli.args import add_fields, choice, config_from, field_docs

_FLAGS = {
    "precision": {"type": choice(PRECISIONS), "metavar": "{" + ",".join(PRECISIONS) + "}"},
    "channels_last": None, "cudnn_benchmark": None,
    "optimizer_impl": {"type": choice(OPTIMIZER_IMPLS),
                       "metavar": "{" + ",".join(OPTIMIZER_IMPLS) + "}"},
    "fused_bn": None, "fast_stem": None, "matmul_1x1": None, "wgrad_stream": None,
    "fused_loss": None,
    "combo_kernels": None, "cuda_graph": None, "keep_memory": None,
    "loss_scale_init": {"metavar": "SCALE"},
    "steps_per_call": {"metavar": "K"},
    **{name: {"type": choice(values), "metavar": "{" + ",".join(values) + "}"}
       for name, values in (("activation_checkpointing", CHECKPOINTING_MODES),
                            ("sdpa_backend", SDPA_BACKENDS),
                            ("float8", get_args(Float8)))},
}


def add_accel_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per lever (``--precision``, ``--channels-last``, ..., ``--compile [MODE]``)."""
    g = parser.add_argument_group("acceleration levers (the rungs of `kasoku bench`'s ladder)")
    add_fields(g, AccelConfig, _FLAGS)
    docs = field_docs(AccelConfig)
    g.add_argument("--compile", nargs="?", const="default", default=None,
                   type=choice(COMPILE_MODES), metavar="MODE",
                   help=f"{docs['compile']} MODE: {docs['compile_mode']}".replace("%", "%%"))


def accel_config_from_args(args: argparse.Namespace) -> AccelConfig:
    """The ``AccelConfig`` of parsed arguments (unset flags keep its defaults)."""
    mode = getattr(args, "compile", None)
    extra = {"compile": mode is not None}
    if mode is not None:
        extra["compile_mode"] = mode
    return config_from(args, AccelConfig, **extra)
