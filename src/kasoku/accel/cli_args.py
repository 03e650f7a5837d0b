"""Command-line flags of the acceleration levers, shared by ``kasoku train`` and ``kasoku
bench``: ``add_accel_arguments(parser)`` then ``accel_config_from_args(args)``. The help texts
are ``AccelConfig``'s field docstrings."""
from __future__ import annotations

import argparse
import ast
import functools
import inspect

from kasoku.accel.compile import COMPILE_MODES
from kasoku.accel.config import OPTIMIZER_IMPLS, PRECISIONS, AccelConfig


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry a string literal below them."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: flags without help texts
        return {}
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def add_accel_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--precision``, ``--channels-last``, ``--cudnn-benchmark``, ``--optimizer-impl``,
    ``--fused-bn``, ``--fast-stem``, ``--matmul-1x1``, ``--wgrad-stream``, ``--compile [MODE]``,
    ``--combo-kernels``, ``--cuda-graph``, ``--loss-scale-init`` and ``--steps-per-call`` to
    ``parser``."""
    d = AccelConfig()
    # "%" would be read as a format specifier by argparse's help.
    h = {k: field_docs(AccelConfig).get(k, "").replace("%", "%%")
         for k in AccelConfig.__dataclass_fields__}
    g = parser.add_argument_group("acceleration levers (seed 004)")
    g.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help=f"{h['precision']} (default: {d.precision})")
    g.add_argument("--channels-last", action="store_true", help=h["channels_last"])
    g.add_argument("--cudnn-benchmark", action="store_true", help=h["cudnn_benchmark"])
    g.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=d.optimizer_impl,
                   help=f"{h['optimizer_impl']} (default: {d.optimizer_impl})")
    g.add_argument("--fused-bn", action="store_true", help=h["fused_bn"])
    g.add_argument("--fast-stem", action="store_true", help=h["fast_stem"])
    g.add_argument("--matmul-1x1", action="store_true", help=h["matmul_1x1"])
    g.add_argument("--wgrad-stream", action="store_true", help=h["wgrad_stream"])
    g.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   metavar="MODE", help=f"{h['compile']} MODE: {h['compile_mode']}")
    g.add_argument("--combo-kernels", action="store_true", help=h["combo_kernels"])
    g.add_argument("--cuda-graph", action="store_true", help=h["cuda_graph"])
    g.add_argument("--loss-scale-init", type=float, default=d.loss_scale_init,
                   help=f"{h['loss_scale_init']} (default: {d.loss_scale_init:g})")
    g.add_argument("--steps-per-call", type=int, default=d.steps_per_call, metavar="K",
                   help=f"{h['steps_per_call']} (default: {d.steps_per_call})")


def accel_config_from_args(args: argparse.Namespace) -> AccelConfig:
    """The ``AccelConfig`` of parsed arguments (from a parser given ``add_accel_arguments``)."""
    return AccelConfig(precision=args.precision, channels_last=args.channels_last,
                       cudnn_benchmark=args.cudnn_benchmark, optimizer_impl=args.optimizer_impl,
                       fused_bn=args.fused_bn, fast_stem=args.fast_stem,
                       matmul_1x1=args.matmul_1x1, wgrad_stream=args.wgrad_stream,
                       compile=args.compile is not None,
                       compile_mode=args.compile or AccelConfig.compile_mode,
                       combo_kernels=args.combo_kernels,
                       cuda_graph=args.cuda_graph, loss_scale_init=args.loss_scale_init,
                       steps_per_call=args.steps_per_call)
