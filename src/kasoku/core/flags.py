"""The one map between a run's settings and kasoku's command line: each field of a
``kasoku.run.RunConfig`` (``"accel.cuda_graph"``: its section, a dot, the field) to the flag
that sets it. The parser takes its flags from here (``kasoku.cli.args.add_fields``); a lever
is a change of fields (``{"accel.compile": True}``) and the A/B runner turns it into
arguments with ``to_args``; an error message names a setting by ``flag(key)``. Written out
rather than derived from the field names because a third of the flags are not their field's
name (``--data`` for ``data.root``, ``--no-progress`` for ``train.progress``, the
``--kfac-`` prefix), and a rename of either side should fail a test, not change the command
line silently.

Imports nothing: every layer may name a flag.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

FLAGS: dict[str, str] = {
    # kasoku.data.config.DataConfig
    "data.root": "--data",
    "data.synthetic": "--synthetic",
    "data.synthetic_train_size": "--synthetic-size",
    "data.download": "--download",
    "data.cache": "--data-cache",
    "data.strict": "--strict-data",
    # kasoku.train.config.TrainConfig
    "train.epochs": "--epochs",
    "train.batch_size": "--batch-size",
    "train.lr": "--lr",
    "train.grad_clip": "--grad-clip",
    "train.optimizer": "--optimizer",
    "train.seed": "--seed",
    "train.device": "--device",
    "train.out": "--out",
    "train.overwrite": "--overwrite",
    "train.log_interval": "--log-interval",
    "train.snapshot_interval": "--snapshot-interval",
    "train.loader": "--loader",
    "train.prefetch": "--prefetch",
    "train.loader_cores": "--no-loader-cores",
    "train.threads": "--threads",
    "train.progress": "--no-progress",
    # kasoku.accel.config.AccelConfig
    "accel.precision": "--precision",
    "accel.channels_last": "--channels-last",
    "accel.cudnn_benchmark": "--cudnn-benchmark",
    "accel.optimizer_impl": "--optimizer-impl",
    "accel.fused_bn": "--fused-bn",
    "accel.fast_stem": "--fast-stem",
    "accel.matmul_1x1": "--matmul-1x1",
    "accel.wgrad_stream": "--wgrad-stream",
    "accel.keep_memory": "--keep-memory",
    "accel.activation_checkpointing": "--activation-checkpointing",
    "accel.sdpa_backend": "--sdpa-backend",
    "accel.float8": "--float8",
    "accel.fused_loss": "--fused-loss",
    "accel.compile": "--compile",
    "accel.compile_mode": "--compile",
    "accel.combo_kernels": "--combo-kernels",
    "accel.cuda_graph": "--cuda-graph",
    "accel.loss_scale_init": "--loss-scale-init",
    "accel.steps_per_call": "--steps-per-call",
    # kasoku.distributed.config.DistConfig
    "dist.gpus": "--gpus",
    "dist.procs": "--procs",
    "dist.nnodes": "--nnodes",
    "dist.node_rank": "--node-rank",
    "dist.rdzv_endpoint": "--rdzv-endpoint",
    "dist.max_restarts": "--max-restarts",
    "dist.dist_timeout": "--dist-timeout",
    "dist.bucket_mb": "--bucket-mb",
    "dist.static_graph": "--static-graph",
    "dist.allreduce_dtype": "--allreduce-dtype",
    "dist.sync_bn": "--sync-bn",
    "dist.shard": "--shard",
    "dist.numa_binding": "--numa-binding",
    "dist.scale_lr": "--scale-lr",
    # kasoku.kfac.config.KFACConfig
    "kfac.base": "--kfac-base",
    "kfac.method": "--kfac-method",
    "kfac.damping": "--kfac-damping",
    "kfac.factor_decay": "--kfac-factor-decay",
    "kfac.kl_clip": "--kfac-kl-clip",
    "kfac.factor_update_freq": "--kfac-factor-update-freq",
    "kfac.inv_update_freq": "--kfac-inv-update-freq",
    "kfac.factor_precision": "--kfac-factor-precision",
    "kfac.factor_comm_dtype": "--kfac-factor-comm-dtype",
}

OFF_SWITCHES = frozenset({"train.progress", "train.loader_cores"})
"""Fields that are on by default, whose flag turns them off."""

SHARED = {"accel.compile_mode": "accel.compile"}
"""Fields set by another field's flag: ``--compile MODE`` sets ``compile`` and its mode."""


def flag(key: str) -> str:
    """The flag that sets field ``key`` (``"accel.cuda_graph"`` -> ``--cuda-graph``), or a
    command's option that is no field of a run (``"train.resume"`` -> ``--resume``, from
    ``OPTIONS`` below)."""
    return FLAGS[key] if key in FLAGS else OPTIONS[key]


def to_args(changes: Mapping[str, object]) -> tuple[str, ...]:
    """The arguments that set ``changes`` (field key -> value): a switch's flag alone
    (``True``, or ``False`` for an off switch), a setting's flag and value, ``--compile MODE``
    once for ``compile`` with ``compile_mode``. A value no flag can set (turning an on switch
    off, an off switch on) is a ``ValueError``: a lever must be a change the command line can
    make."""
    out: list[str] = []
    for key, value in changes.items():
        name = FLAGS[key]
        if key in SHARED and SHARED[key] in changes:
            continue  # said by the field whose flag it shares (below)
        if key == "accel.compile" and "accel.compile_mode" in changes:
            if value is not True:
                raise ValueError("a compile mode needs compile on")
            mode = changes["accel.compile_mode"]
            out += [name] if mode == "default" else [name, str(mode)]
        elif isinstance(value, bool):
            if value is (key in OFF_SWITCHES):
                raise ValueError(f"no flag sets {key} to {value}")
            out.append(name)
        elif value is None:
            raise ValueError(f"no flag sets {key} to None")
        else:
            out += [name, _text(value)]
    return tuple(out)


def args_text(changes: Mapping[str, object]) -> str:
    """``to_args`` as a line: ``--precision bf16 --channels-last``."""
    return " ".join(to_args(changes))


def from_args(args: Iterable[str]) -> dict[str, object]:
    """The field changes of arguments made by ``to_args``: a flag followed by a value sets
    it (as text), a flag alone is a switch. Arguments that are no run's flag are a
    ``ValueError``."""
    by_flag = {name: key for key, name in FLAGS.items() if key not in SHARED}
    tokens, out = list(args), {}
    i = 0
    while i < len(tokens):
        name = tokens[i]
        if name not in by_flag:
            raise ValueError(f"{name!r} is not a flag of a run's settings")
        key = by_flag[name]
        value_follows = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        if key == "accel.compile":
            out[key] = True
            if value_follows:
                out["accel.compile_mode"] = tokens[i + 1]
        elif value_follows:
            out[key] = tokens[i + 1]
        else:
            out[key] = key not in OFF_SWITCHES
        i += 2 if value_follows else 1
    return out


def _text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- kasoku profile's own options, and a script's levers -------------------------------------

PROFILE_OPTIONS: dict[str, str] = {
    # kasoku.commands.profile_config.ProfileConfig
    "steps": "--steps",
    "warmup": "--warmup",
    "skip": "--skip",
    "measure_steps": "--measure-steps",
    "measure_seconds": "--measure-seconds",
    "confirm": "--confirm",
    "estimate": "--estimate",
    "rounds": "--rounds",
    "python": "--python",
    "stop_after_window": "--stop-after-window",
    # kasoku.cli.profile's own
    "out": "--out",
    "measure_only": "--measure-only",
    "with": "--with",
}
"""``kasoku profile``'s options that are no run's field (what to profile, how, where to write
it), by name: the A/B runner drops and adds them around a run's arguments."""

SCRIPT_COMMAND = "--"
"""What separates ``kasoku profile``'s options from a script's command."""

WITH = "with."
"""The section of a script's levers in a change: ``{"with.workers": 4}`` is ``--with
workers=4`` (``kasoku.commands.script_levers.ScriptLevers``, by field)."""


def option(name: str) -> str:
    """The flag of ``kasoku profile``'s option ``name`` (``"measure_only"`` ->
    ``--measure-only``)."""
    return PROFILE_OPTIONS[name]


def setting_flag(name: str) -> str:
    """The flag of a workload's setting (gpt's ``attention`` -> ``--attention``), named after
    it as ``kasoku.cli.train.add_workload_settings`` makes it."""
    return OPTIONS.get(f"workload.{name}", "--" + name.replace("_", "-"))


def profile_args(options: Mapping[str, object]) -> tuple[str, ...]:
    """``kasoku profile``'s own options as arguments: a switch's flag alone (``True``), a
    setting's flag and value."""
    out: list[str] = []
    for name, value in options.items():
        out += [option(name)] if value is True else [option(name), _text(value)]
    return tuple(out)


def with_value(key: str, value: object) -> str:
    """The ``--with`` value of a script lever's field: ``("with.workers", 4)`` ->
    ``workers=4``, ``("with.pin_memory", True)`` -> ``pin-memory``."""
    name = key.removeprefix(WITH).replace("_", "-")
    return name if value is True else f"{name}={value}"


def with_args(*values: str) -> tuple[str, ...]:
    """``--with VALUE`` for each value."""
    return tuple(token for value in values for token in (option("with"), value))


def change_args(change: Mapping[str, object]) -> tuple[str, ...]:
    """The arguments of a lever's change: a run's fields by ``to_args``, then a script's
    levers (``with.`` keys) as ``--with`` values."""
    run = {k: v for k, v in change.items() if not k.startswith(WITH)}
    return to_args(run) + with_args(*(with_value(k, v) for k, v in change.items()
                                      if k.startswith(WITH)))


def without(argv: Iterable[str], takes: Mapping[str, int]) -> list[str]:
    """``argv`` less each flag of ``takes`` and the number of values it takes there (``--flag
    V``; ``--flag=V`` is one token)."""
    kept, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name, joined, _ = token.partition("=")
        if name in takes:
            skip = 0 if joined else takes[name]
            continue
        kept.append(token)
    return kept


def change_of(args: Iterable[str]) -> dict[str, object]:
    """The change that ``change_args`` made ``args`` from (values as text): how a
    ``profile.json`` written before levers held their change is read."""
    tokens, run, scripts = list(args), [], {}
    i = 0
    while i < len(tokens):
        if tokens[i] == option("with") and i + 1 < len(tokens):
            name, _, value = tokens[i + 1].partition("=")
            scripts[WITH + name.replace("-", "_")] = value or True
            i += 2
        else:
            run.append(tokens[i])
            i += 1
    return {**from_args(run), **scripts}


# The options of kasoku's commands that are no field of a run: a command's own settings
# (``kasoku profile --skip``, ``kasoku data bench --warmup``) that messages below the command
# line name. Keyed "command.option"; ``flag`` looks here after ``FLAGS``.
OPTIONS: dict[str, str] = {
    # kasoku train (and profile, bench, scale: the workload's own settings)
    "train.resume": "--resume",
    "workload.model_size": "--model-size",
    "workload.attention": "--attention",
    # kasoku profile: its options above
    **{f"profile.{name}": value for name, value in PROFILE_OPTIONS.items()},
    # kasoku bench
    "bench.config": "--config",
    "bench.full": "--full",
    "bench.ladder": "--ladder",
    "bench.report": "--report",
    # kasoku compare
    "compare.devices": "--devices",
    "compare.scale": "--scale",
    # kasoku scale
    "scale.out": "--out",
    "scale.windows": "--windows",
    # kasoku data download
    "data_download.out": "--out",
    # kasoku data make-jpeg
    "make_jpeg.count": "--count",
    "make_jpeg.classes": "--classes",
    "make_jpeg.resolution": "--resolution",
    # kasoku data bench
    "data_bench.resolution": "--resolution",
    "data_bench.images": "--images",
    "data_bench.image_size": "--image-size",
    "data_bench.warmup": "--warmup",
    "data_bench.batches": "--batches",
    "data_bench.windows": "--windows",
    "data_bench.model": "--model",
    "data_bench.report": "--report",
}
