"""A ``--config`` rung of ``kasoku bench``, ``compare`` and ``scale`` read without torch, so
that a mistake in it is said before torch loads (``kasoku.cli.bench``): ``LADDER_LABELS``, the
labels of the ladders' rungs (``kasoku.commands.bench.rungs``), and ``parse_spec``, lever
settings as an ``AccelConfig``."""
from __future__ import annotations

import dataclasses
from dataclasses import fields

from kasoku.accel.config import PRECISIONS, AccelConfig, check_choices
from kasoku.core.errors import ConfigError

LADDER_LABELS = ("plain", "fp32", "tf32", "amp", "+channels_last", "+fused", "+keep-memory",
                 "+bf16", "+compile", "+cuda-graph", "+fused-bn", "+fast-stem",
                 "+combo-kernels", "+matmul-1x1", "+wgrad-stream", "+float8")
"""The label of every rung of the GPU, transformer and CPU ladders (one of them the rung a
``--config`` of that label names, on the device's ladder)."""


SHORT_CPU_LADDER = ("plain", "fp32", "+fused")
"""The CPU ladder ``kasoku bench`` climbs by default, in about a minute on 2 cores: plain
PyTorch, kasoku's step with the same settings (the numerics guard's reference, and what
kasoku's step itself costs) and the fused update, the CPU's largest lever on every CPU measured
(docs/benchmarks.md: the 2-core EPYC and the 16-core Xeon). The rest is a flag away."""


_ALIASES = {"fused": ("optimizer_impl", "fused"), "foreach": ("optimizer_impl", "foreach"),
            "loop": ("optimizer_impl", "loop"), "cudnn": ("cudnn_benchmark", True),
            "graph": ("cuda_graph", True)}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_spec(spec: str) -> AccelConfig:
    """``"precision=bf16,channels_last,compile=max-autotune"`` -> ``AccelConfig``, its values
    checked against their choices (``check_choices``), its combinations not
    (``kasoku.commands.bench.rungs.parse_config`` adds them).

    Keys are ``AccelConfig`` fields (``-`` may stand for ``_``); a bare key turns a boolean on;
    ``compile=MODE`` turns compilation on in that mode; ``fused``/``foreach``/``loop`` set the
    optimizer implementation; ``bf16``-style bare precisions set the precision. Unset keys
    keep ``AccelConfig``'s defaults. Unknown keys and values raise ``ConfigError``."""
    known = {f.name: f for f in fields(AccelConfig)}
    values: dict = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, has_value, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not has_value and key in PRECISIONS:  # before "-" becomes "_": fp16-pure
            key, has_value, raw = "precision", True, key
        key = key.replace("-", "_")
        if not has_value and key in _ALIASES:
            name, value = _ALIASES[key]
            values[name] = value
            continue
        if key not in known:
            raise ConfigError(f"unknown bench config key {key!r} in {spec!r}; known keys: "
                              f"{', '.join(known)} (plus the shorthands "
                              f"{', '.join(_ALIASES)} and a bare precision)")
        values.update(_parse_value(key, raw if has_value else None, known[key], spec))
    if not any(part.strip() for part in spec.split(",")):
        raise ConfigError(f"rung {spec!r} names no lever; give a ladder label (amp, +compile) "
                          f"or settings such as precision=bf16,channels_last")
    config = AccelConfig(**values)
    check_choices(config)  # unknown values, said the accel way
    return config


def _parse_value(key: str, raw: str | None, field: dataclasses.Field, spec: str) -> dict:
    if key == "compile" and raw is not None and raw.lower() not in _TRUE + _FALSE:
        return {"compile": True, "compile_mode": raw}
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind == "bool":
        if raw is None or raw.lower() in _TRUE:
            return {key: True}
        if raw.lower() in _FALSE:
            return {key: False}
        raise ConfigError(f"{key} takes on/off (or no value), got {raw!r} in {spec!r}")
    if raw is None or raw == "":
        raise ConfigError(f"{key} needs a value ({key}=...) in {spec!r}")
    if key == "optimizer_impl" and raw.lower() in ("none", "auto", "default"):
        return {key: None}
    if kind in ("float", "int"):
        try:
            return {key: float(raw) if kind == "float" else int(raw)}
        except ValueError:
            raise ConfigError(f"{key} takes a{'' if kind == 'float' else ' whole'} number, "
                              f"got {raw!r} in {spec!r}") from None
    return {key: raw}
