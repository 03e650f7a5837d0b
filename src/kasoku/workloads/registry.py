"""Workload registry: ``@register_workload``, ``create_workload``, ``list_workloads``.

A workload bundles what a seed study trains: a model, its data (real and synthetic), a loss,
a metric and a default recipe. Tests sweep the whole registry, so a new entry is covered.

A workload with settings of its own (gpt's model size) takes them in its name,
``NAME:KEY=VALUE,...`` (``gpt:model_size=small,attention=plain``), so they travel with the
name wherever a run goes (a bench worker's request, a data-parallel worker's command line);
the command line's flags made from the settings' fields (``--model-size``) add them there.

The registry and the built-in workloads' classes load without torch: what a workload is (its
description, recipe and settings: ``kasoku list``, the command line's flags) is known before
anything is built; a workload imports torch, its model and its data in the methods that build
them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kasoku.perf.flops import StepFlops


@dataclass(frozen=True)
class Recipe:
    """Default training recipe of a workload (seed 001 where it gives one)."""
    optimizer: str = "adam"
    """sgd | momentum | adam | adamw"""
    lr: float = 1e-3
    momentum: float = 0.9
    betas: tuple[float, float] | None = None
    """adam's and adamw's moment decays (None: torch's, (0.9, 0.999))."""
    weight_decay: float = 0.0
    batch_size: int = 100
    epochs: float = 20
    schedule: str = "none"
    """none | step | cosine (see kasoku.train.extensions.lr_schedule)"""
    warmup_epochs: float = 0.0
    grad_clip: float | None = None
    """The gradients' global norm clipped to this before each update (None: not clipped)."""
    eval_batch_size: int | None = None
    """Validation batch (None: at least the training batch; 1,000 with the device loader, 100
    otherwise). Evaluation keeps no activations for a backward pass, so a small model can
    take its whole validation set in a few launches."""


CPU_MAX_BATCH = 100
"""The largest default batch ``kasoku compare`` and ``kasoku bench`` time on a CPU (seed 001's
batch, the README's CPU row; ResNet-152's recipe batch of 2048 would take minutes per step)."""


def default_batch_sizes(recipe_batch: int, command: Literal["bench", "compare", "scale", "data"],
                        device_type: str = "cpu", full: bool = False) -> tuple[int, ...]:
    """The batch sizes a command measures when ``--batch-size`` is not given, from the recipe's
    batch ``b``: ``kasoku bench`` sweeps b/8, b/4, b/2 and b on a GPU (each at least 1); on a
    CPU it times b, at most ``CPU_MAX_BATCH`` (a minute's ladder whose rates read against the
    recipe's), and with ``full`` b/8 and b/4 before it; ``compare`` times b, on a CPU at most
    ``CPU_MAX_BATCH``; ``scale`` and ``data bench`` time b."""
    b = recipe_batch
    if command == "bench":
        if device_type == "cuda":
            sizes = [b // 8, b // 4, b // 2, b]
        else:
            sizes = [b // 8, b // 4, min(b, CPU_MAX_BATCH)] if full else [min(b, CPU_MAX_BATCH)]
        return tuple(sorted({max(1, s) for s in sizes}))
    if command == "compare" and device_type == "cpu":
        return (min(b, CPU_MAX_BATCH),)
    return (b,)


class Workload:
    """Base class. Subclasses set the class attributes and implement the builders."""
    name: str = ""
    description: str = ""
    recipe: Recipe = Recipe()
    has_accuracy: bool = True
    """False for regression workloads (no main/accuracy column)."""
    cpu_threads: int | None = None
    """Preferred PyTorch CPU threads (None: one per core); tiny models run faster on one."""
    generated_data: bool = False
    """True when the workload generates its data (no files, ``--data`` is ignored)."""
    sample_unit: str = "samples"
    """What a sample is called in rates: ``images`` for image models (images/s)."""
    units_per_sample: int = 1
    """How many ``sample_unit``s one sample holds, where rates count less than a sample: a
    language model's sample is a sequence of ``block_size`` tokens, its rates are tokens/s."""
    epoch_samples: int | None = None
    """Training samples in one epoch of the workload's real dataset, in ``sample_unit``s (what
    ``kasoku compare`` extrapolates an epoch's time to from a measured rate); None: not
    known."""
    default_data: str | None = None
    """What the workload trains on without ``--data``, in words, where every machine has it
    (gpt: the Python standard library's sources); None: real data needs ``--data``."""
    ladder: str = "default"
    """Which GPU ladder ``kasoku bench`` climbs: default (the conv nets' levers, those that do
    not apply dropped) or transformer (``kasoku.commands.bench.rungs.transformer_ladder``)."""
    config_class: type | None = None
    """The dataclass of the workload's own settings (``NAME:KEY=VALUE,...``), or None. Its
    fields' docstrings are the flags' help; a class attribute ``choices`` (field -> allowed
    values) makes those flags take only these."""

    def __init__(self, config=None):
        self.config = config if config is not None or self.config_class is None \
            else self.config_class()

    @property
    def spec(self) -> str:
        """What makes this workload again (``create_workload``): ``FILE.py:NAME`` for one of
        a file, else its name with every one of its settings, ``NAME:KEY=VALUE,...``."""
        if getattr(self, "_spec", None) is not None:
            return self._spec
        settings = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) \
            else {}
        return with_settings(self.name, settings)

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_datasets(self, data: DataConfig, seed: int = 0):
        """Return ``(train_set, val_set)``: real data from ``data.root``, or synthetic data of
        the same shapes when ``data.synthetic``. Missing real data raises ``DataError`` saying
        where to put it, how to download it, and that ``--synthetic`` exists."""
        raise NotImplementedError

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch  # deferred (module doc): as cheap as a global's lookup, not so `from`
        return torch.nn.functional.cross_entropy(output, target)

    loss_fn.cross_entropy = True  # the fused_loss lever may stand in for it

    def metric_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Accuracy for classification (a 0-dim tensor, no host sync); None when not defined."""
        return (output.argmax(dim=1) == target).float().mean()

    def step_flops(self, model: nn.Module, make_batch, batch_size: int) -> StepFlops:
        """The model FLOPs of one training step at ``batch_size`` (what MFU divides): counted
        (``kasoku.perf.flops.count_step_flops``) unless the workload knows a formula."""
        from kasoku.perf.flops import count_step_flops  # deferred: torch (module doc)
        return count_step_flops(model, make_batch, self.loss_fn, batch_size)

    def __repr__(self) -> str:
        return f"<workload {self.name}: {self.description}>"


_REGISTRY: dict[str, Callable[[], Workload]] = {}


def register_workload(name: str):
    """Class decorator: register a ``Workload`` subclass under ``name``."""
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"workload {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def list_workloads() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_workload(name: str, **recipe_overrides) -> Workload:
    """Instantiate a workload: a registered name (``kasoku list``), or ``FILE.py:NAME``, a
    user's own: ``NAME`` in the Python file ``FILE.py``, a ``Workload`` subclass or a function
    returning a ``Workload`` (see ``examples/``); a registered name may carry the workload's
    settings, ``NAME:KEY=VALUE,...`` (``split_settings``). Keyword arguments override fields
    of its recipe."""
    _load_builtin()
    spec = name
    name, settings = split_settings(spec)
    if is_file_spec(name):
        wl = _workload_from_file(name)
        wl._spec = name
        if settings:
            raise ConfigError(f"workload {spec!r}: a workload of your own takes no settings "
                              f"in its name")
    elif name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown workload {name!r}; known workloads: {known} (see `kasoku "
                          f"list`), or FILE.py:NAME for a workload of your own")
    else:
        cls = _REGISTRY[name]
        wl = cls(_config(cls, spec, settings)) if settings else cls()
    overrides = {k: v for k, v in recipe_overrides.items() if v is not None}
    if overrides:
        wl.recipe = replace(wl.recipe, **overrides)
    return wl


def split_settings(spec: str) -> tuple[str, dict[str, str]]:
    """``"gpt:model_size=small,attention=plain"`` -> ``("gpt", {"model_size": "small",
    "attention": "plain"})``; a name without settings -> ``(name, {})``. ``-`` in a key stands
    for ``_``."""
    head, sep, tail = str(spec).rpartition(":")
    if not sep or "=" not in tail:
        return str(spec), {}
    settings = {}
    for item in (part.strip() for part in tail.split(",") if part.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"workload {spec!r}: settings are KEY=VALUE,..., got {item!r}")
        settings[key.strip().replace("-", "_")] = value.strip()
    return head, settings


def with_settings(spec: str, settings: dict) -> str:
    """``spec`` with ``settings`` (those not None) added to, or replacing, those it names."""
    name, given = split_settings(spec)
    given.update({k: str(v) for k, v in settings.items() if v is not None})
    return f"{name}:{','.join(f'{k}={v}' for k, v in given.items())}" if given else name


def workload_configs() -> dict[str, type]:
    """``{workload name: settings dataclass}`` of the registered workloads that have one."""
    _load_builtin()
    return {name: cls.config_class for name, cls in sorted(_REGISTRY.items())
            if cls.config_class is not None}


def _config(cls, spec: str, settings: dict[str, str]):
    if cls.config_class is None:
        raise ConfigError(f"workload {spec!r}: {cls.name} takes no settings")
    known = [f.name for f in fields(cls.config_class)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"workload {spec!r}: {cls.name} has no setting "
                          f"{', '.join(unknown)}; its settings: {', '.join(known)}")
    return cls.config_class(**settings)


def is_file_spec(name: str) -> bool:
    """Whether ``name`` is ``FILE.py:NAME`` (a workload defined in a file) rather than a
    registered name."""
    path, sep, attr = str(name).rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(attr)


_FILE_MODULES: dict[str, object] = {}


def _workload_from_file(spec: str) -> Workload:
    path, _, attr = spec.rpartition(":")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"workload {spec!r}: no such file {path}; give FILE.py:NAME with the "
                          f"path of a Python file that defines NAME")
    module = _FILE_MODULES.get(str(file))
    if module is None:
        import importlib.util
        import sys
        module_name = f"kasoku_user_{abs(hash(str(file)))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ConfigError(f"workload {spec!r}: running {path} failed "
                              f"({type(exc).__name__}: {exc}); fix the file") from exc
        _FILE_MODULES[str(file)] = module
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type)
                       and issubclass(v, Workload) and v is not Workload)
        raise ConfigError(f"workload {spec!r}: {path} defines no {attr!r}"
                          + (f"; its Workload classes: {', '.join(found)}" if found else ""))
    obj = getattr(module, attr)
    try:
        wl = obj() if callable(obj) else obj
    except Exception as exc:
        raise ConfigError(f"workload {spec!r}: calling {attr}() failed "
                          f"({type(exc).__name__}: {exc}); fix the file") from exc
    if not isinstance(wl, Workload):
        raise ConfigError(f"workload {spec!r}: {attr} is not a kasoku Workload (it gave a "
                          f"value of type {type(wl).__name__}); make it a Workload subclass or "
                          f"a function returning one")
    missing = [m for m in ("build_model", "build_datasets")
               if getattr(type(wl), m) is getattr(Workload, m)]
    if missing:
        raise ConfigError(f"workload {spec!r}: {type(wl).__name__} does not define "
                          f"{' or '.join(m + '()' for m in missing)}; a Workload defines "
                          f"build_model() and build_datasets(data, seed) (see "
                          f"examples/stripes_cnn.py)")
    if not wl.name:
        wl.name = attr
    return wl


def _load_builtin() -> None:
    # Importing the package registers the built-in workloads (one module each).
    import kasoku.workloads  # noqa: F401  (deferred: the package imports this module first)
