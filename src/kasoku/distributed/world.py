"""A process's place in a distributed job, as ``torchrun`` (and SLURM through it) describes it in
the environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from kasoku.core.errors import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    """This process's number among all processes of the job, from 0."""
    world_size: int = 1
    """Processes in the job."""
    local_rank: int = 0
    """This process's number on its machine (which GPU it takes)."""

    @property
    def is_main(self) -> bool:
        """Whether this process prints, logs, plots and writes snapshots (rank 0)."""
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "World":
        """The world the environment describes; one process (rank 0 of 1) when it says
        nothing. Values that are not whole numbers, or a rank outside the world, are a
        ``ConfigError`` naming the variable."""
        env = os.environ if environ is None else environ
        values = {}
        for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
            text = env.get(key, "").strip()
            if not text:
                values[key] = default
                continue
            if not text.isdigit():
                raise ConfigError(f"environment variable {key}={text!r} is not a whole number "
                                  f">= 0; unset it or start the job with torchrun")
            values[key] = int(text)
        world = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
        if world.world_size < 1 or world.rank >= world.world_size:
            raise ConfigError(f"RANK={world.rank} is not in a world of WORLD_SIZE="
                              f"{world.world_size} processes; unset both or start the job with "
                              f"torchrun")
        return world


def require_single_process(world: World, command: str) -> None:
    """Refuse to run ``command`` as one of several processes: it would train (or measure) an
    unsynchronized copy in each of them."""
    if world.world_size > 1:
        raise ConfigError(f"{command} was started as process {world.rank} of "
                          f"{world.world_size} (RANK/WORLD_SIZE set, as torchrun does), but it "
                          f"runs in one process; start it without torchrun")


def restart_count(environ=None) -> int:
    """How many times the launcher restarted this worker group (0 on the first attempt)."""
    env = os.environ if environ is None else environ
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(text) if text.isdigit() else 0
