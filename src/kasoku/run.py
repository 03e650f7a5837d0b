"""``RunConfig``: one training run, resolved and typed: the workload (its name with every one of
its settings) and the data, train, acceleration, data-parallel and K-FAC configs, with the
workload's recipe applied where the command left a setting to it. ``resolve`` makes it,
``RunConfig.check`` refuses what no run can use (every check of the settings in one place), and
``to_json``/``from_json`` carry it to a worker process unchanged.

What is left open here is what only the process that trains can decide: the device (``auto``
is resolved where the run happens), the CPU threads (they depend on the device and the number
of workers on the machine) and a resumed run's seed (its snapshot's).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from kasoku.accel.config import AccelConfig
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.distributed.config import DistConfig
from kasoku.kfac.config import KFACConfig
from kasoku.train.config import OPTIMIZERS, TrainConfig

RECIPE_FIELDS = ("epochs", "batch_size", "lr", "grad_clip", "optimizer")
"""The ``TrainConfig`` fields that default to the workload's recipe."""


@dataclass(frozen=True)
class RunConfig:
    workload: str
    """The spec that makes the workload (``kasoku.workloads.create_workload``): a registered
    name with every one of its settings, ``NAME:KEY=VALUE,...``, or ``FILE.py:NAME``."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    """With the recipe's epochs, batch size, learning rate, clipping and optimizer where the
    command gave none, and seed 0 where it gave none."""
    accel: AccelConfig = field(default_factory=AccelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    kfac: KFACConfig | None = None
    """Optimizer kfac's settings as given; None: none given (``KFACConfig()`` applies)."""
    given: tuple[str, ...] = ()
    """The ``TrainConfig`` fields the command set itself (sorted), as against the recipe's and
    the defaults: a resume lets a given ``lr`` replace its snapshot's, and a given ``seed``
    that differs from the snapshot's is warned about."""

    @property
    def kfac_or_default(self) -> KFACConfig:
        return self.kfac or KFACConfig()

    def check(self) -> None:
        """Refuse what no run can use (``ConfigError`` saying what to do instead): each
        config's own values, the levers' combinations, the loader's settings, the optimizer
        with K-FAC's settings and levers, and what a sharded model cannot take."""
        # The checks that live beside the levers, the loaders and K-FAC import torch: only
        # when a run is checked, not when its config is read.
        from kasoku.accel.compose import check_config, check_sharding  # deferred: torch
        from kasoku.data.registry import check_loader_settings  # deferred: torch
        from kasoku.kfac import check_levers  # deferred: torch
        self.train.check()
        check_config(self.accel)
        check_loader_settings(self.train.loader, self.accel.steps_per_call, self.train.prefetch)
        self.dist.check()
        optimizer = self.train.optimizer
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of "
                              f"{', '.join(OPTIMIZERS)}")
        if optimizer == "kfac":
            self.kfac_or_default.check()
            check_levers(self.accel)
        if self.dist.shard:
            check_sharding(self.accel, optimizer)

    def to_json(self) -> str:
        """The run as one JSON object (``from_json`` makes the same ``RunConfig`` of it)."""
        return json.dumps(dataclasses.asdict(self), default=str, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return decode(cls, json.loads(text))


@dataclass(frozen=True)
class TrainRequest:
    """What a worker of ``kasoku train --gpus N``/``--procs N`` is started with
    (``kasoku.cli.train_worker``): the run the launching process resolved and checked, the
    ``--resume`` given, and the command's words with the run folder fixed, from which a worker
    that cannot tell the launching process where it stopped says how to continue."""
    run: RunConfig
    resume: str | None = None
    argv: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"run": dataclasses.asdict(self.run), "resume": self.resume,
                           "argv": list(self.argv)}, default=str)

    @classmethod
    def from_json(cls, text: str) -> TrainRequest:
        data = json.loads(text)
        return cls(decode(RunConfig, data["run"]), data["resume"], tuple(data["argv"]))


def resolve(workload, data: DataConfig | None = None, train: TrainConfig | None = None,
            accel: AccelConfig | None = None, dist: DistConfig | None = None,
            kfac: KFACConfig | None = None) -> RunConfig:
    """The ``RunConfig`` of ``workload`` (a ``kasoku.workloads.Workload``: its ``spec`` and
    ``recipe`` are read) and the configs a command gave (None: the defaults): the train
    settings left unset take the recipe's values (the seed 0). Nothing is checked here
    (``RunConfig.check``)."""
    train = train or TrainConfig()
    given = tuple(sorted(f.name for f in fields(train) if getattr(train, f.name) is not None
                         and f.name in (*RECIPE_FIELDS, "seed")))
    recipe = workload.recipe
    filled = {name: getattr(recipe, name) for name in RECIPE_FIELDS
              if getattr(train, name) is None}
    if train.seed is None:
        filled["seed"] = 0
    return RunConfig(workload.spec, data or DataConfig(), dataclasses.replace(train, **filled),
                     accel or AccelConfig(), dist or DistConfig(), kfac, given)


def decode(cls, value):
    """``cls`` (a config dataclass) of ``value``, a dict from ``dataclasses.asdict`` read back
    from JSON: paths made paths again, tuples tuples, nested configs configs."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    kinds = {f.name: _kind(hints[f.name]) for f in fields(cls) if f.init and f.name in value}
    return cls(**{name: None if value[name] is None
                  else decode(kind, value[name]) if dataclasses.is_dataclass(kind)
                  else Path(value[name]) if kind is Path
                  else tuple(value[name]) if typing.get_origin(kind) is tuple
                  else value[name]  # a number, a name, a switch: as JSON has it
                  for name, kind in kinds.items()})


def _kind(hint):
    """The type of a field's values: ``X`` of ``X | None``."""
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
