"""``ProfileConfig``: the settings of one ``kasoku profile`` (of a workload or of a script),
whose field docstrings are the command line's help texts; in a module of its own, without
torch, so that the command line builds its flags without loading it; and ``ProfileRequest``,
the JSON a data-parallel profile's workers are started with."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kasoku.core.errors import ConfigError
from kasoku.core.flags import flag
from kasoku.run import RunConfig, decode


@dataclass
class ProfileConfig:
    steps: int = 10
    """Steps recorded by the profiler (after its warm-up steps)."""
    warmup: int = 3
    """Profiler warm-up steps before the recorded ones."""
    skip: int = 10
    """Steps run first and not timed (compilation, graph capture, autotuning), at least:
    blocks of as many follow until two agree on the step time and nothing recompiles (a
    script's: exactly this many)."""
    measure_steps: int = 20
    """Steps timed without the profiler (the throughput beside the profiled figures), at
    least; more where they would take under --measure-seconds; with --optimizer kfac,
    rounded up to whole cycles of its factor and inverse steps (a script's: exactly this
    many)."""
    measure_seconds: float = 1.0
    """The unprofiled steps last at least this long (20 steps of a 2 ms step are 40 ms, at
    the mercy of one interruption; K-FAC's whole cycles are kept as --measure-steps asks)."""
    confirm: bool = False
    """Run the A/B runs that prove the bound (each side a fresh process), and the advised
    lever once more, and print them."""
    estimate: bool = False
    """Skip the A/B runs of the candidate levers (a minute or so): advise from the rule's
    estimate, labelled as one."""
    rounds: int = 3
    """Rounds of the candidate levers' A/B runs (each round: the run as given, then each
    lever, fresh processes); fewer are faster and noisier. Stopped early past a minute."""
    python: bool = False
    """Add a host-side sampling profile of the step (pyinstrument; pip install pyinstrument)."""
    stop_after_window: bool = False
    """A script's profile (kasoku profile -- python SCRIPT.py): stop the script cleanly after
    the profiled window instead of letting it run to its end."""


@dataclass(frozen=True)
class ProfileRequest:
    """What a worker of ``kasoku profile --gpus N``/``--procs N`` is started with
    (``kasoku.cli.profile_worker``): the run the launching process resolved and checked, the
    profile's settings, its folder, and whether it is a side of an A/B (``measure_only``: the
    figures printed as one JSON line)."""
    run: RunConfig
    profile: ProfileConfig
    out: Path | None = None
    measure_only: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> ProfileRequest:
        return decode(cls, json.loads(text))


def check_window(cfg) -> None:
    """A script's window needs one step before it (its steps show how it trains)."""
    if cfg.skip < 1:
        raise ConfigError("a script's window starts after its first step at the earliest "
                          f"(its steps show how it trains): give {flag('profile.skip')} 1 or more")
