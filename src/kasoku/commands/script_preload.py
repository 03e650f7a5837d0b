"""The ``--with`` levers that must be in force from a process's start, which no patch inside
the script's process can set later:

- ``allocator[=jemalloc|tcmalloc]``: a malloc from a library found on this machine
  (``find_allocator``: ``ctypes.util.find_library`` and the usual lib folders) first in
  ``LD_PRELOAD``, which the dynamic loader reads only when a process starts. A measuring side's
  process gets it in its environment (``start_env``); ``kasoku run --with allocator`` and
  ``kasoku profile --with allocator`` re-execute themselves with it (``reexec_env``, then
  ``os.execve`` with the same argv) where it is not there yet. Where no library is found the
  lever cannot apply, and says why with what to install (``missing``). No maintained package
  on PyPI ships jemalloc or tcmalloc as a library to preload (conda-forge's ``libjemalloc``
  does; Debian's are ``libjemalloc2`` and ``libtcmalloc-minimal4``);
- ``expandable-segments``: CUDA's caching allocator with expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which it reads when CUDA starts:
  set in ``os.environ`` before the script runs (``expandable_segments``), and in a measuring
  side's environment.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import os
import re
import sys
from pathlib import Path

import torch

from kasoku.distributed.launch import environ_set

ALLOCATORS = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc")}
"""Each malloc ``--with allocator=NAME`` takes, and its libraries' names (``libNAME.so*``),
the first found preloaded; ``--with allocator`` alone takes the first of them found."""
INSTALL = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
"""The Debian package of each, said where none is found."""
LIB_FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64", "/lib")
"""Where the libraries are looked for, after the Python environment's own ``lib`` (a conda
environment's ``libjemalloc``) and before ``ctypes.util.find_library``."""
PRELOAD = "LD_PRELOAD"
CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def find_allocator(names: tuple[str, ...] = tuple(ALLOCATORS)) -> tuple[str, str] | None:
    """``(name, library)`` of the first of ``names`` (``ALLOCATORS``' keys) whose library is
    on this machine: a path from a lib folder, else the name ``find_library`` gives; None
    where none is."""
    for name in names:
        for lib in ALLOCATORS[name]:
            for folder in (Path(sys.prefix) / "lib", *map(Path, LIB_FOLDERS)):
                hits = sorted(folder.glob(f"lib{lib}.so*"))
                if hits:
                    return name, str(hits[0])
            found = ctypes.util.find_library(lib)
            if found:
                return name, found
    return None


def missing(names: tuple[str, ...]) -> str:
    """Why ``--with allocator`` cannot apply: ``no jemalloc or tcmalloc here (apt install
    libjemalloc2)``."""
    return f"no {' or '.join(names)} here (apt install {INSTALL[names[0]]})"


def preloaded(library: str, env=os.environ) -> bool:
    """Whether ``library`` is in ``env``'s ``LD_PRELOAD`` (its entries apart by colons or
    spaces, as the dynamic loader reads them)."""
    return library in re.split(r"[:\s]+", env.get(PRELOAD, ""))


def with_preload(env: dict, library: str) -> dict:
    """``env`` with ``library`` first in ``LD_PRELOAD`` (the entries already there kept)."""
    rest = env.get(PRELOAD, "")
    return {**env, PRELOAD: library + (":" + rest if rest else "")}


def loaded(name: str) -> bool | None:
    """Whether one of ``name``'s libraries is mapped in this process (``/proc/self/maps``);
    None where that cannot be read (not Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return any(f"/lib{lib}.so" in maps for lib in ALLOCATORS[name])


def allocator_unapplied(names: tuple[str, ...]) -> str | None:
    """Why the allocator of ``names`` is not this process's malloc, or None where it is:
    none found (``missing``), or not loaded (``not preloaded``: LD_PRELOAD lacked it at the
    start, or the dynamic loader could not load it)."""
    found = find_allocator(names)
    if found is None:
        return missing(names)
    return None if loaded(found[0]) is not False else "not preloaded (LD_PRELOAD)"


def start_env(env: dict, allocator: tuple[str, ...] = (),
              expandable: bool = False) -> dict:
    """``env`` for a process that runs the script with these levers (a measuring side): the
    allocator's library first in ``LD_PRELOAD`` where one is found (else the side says why
    not), ``PYTORCH_CUDA_ALLOC_CONF`` with expandable segments."""
    found = find_allocator(allocator) if allocator else None
    if found and not preloaded(found[1], env):
        env = with_preload(env, found[1])
    return {**env, CUDA_ALLOC_CONF: _expandable(env.get(CUDA_ALLOC_CONF))} if expandable \
        else env


def reexec_env(allocator: tuple[str, ...]) -> dict | None:
    """This process's environment with the allocator's library first in ``LD_PRELOAD``, to
    execute this process again with (``reexec``), or None where that is not needed (no
    allocator asked for, none found, or preloaded already)."""
    found = find_allocator(allocator) if allocator else None
    if found is None or preloaded(found[1]):
        return None
    return with_preload(dict(os.environ), found[1])


def preload(allocator: tuple[str, ...], argv: list[str] | None = None) -> None:
    """Where the malloc of ``allocator`` is found and not in ``LD_PRELOAD`` yet, this process
    replaced by ``argv`` (default: its own) started with it (``reexec``: never returns), since
    the dynamic loader reads ``LD_PRELOAD`` only at a process's start; else nothing."""
    env = reexec_env(allocator)
    if env is not None:
        reexec(env, argv)


def reexec(env: dict, argv: list[str] | None = None) -> None:
    """This process replaced by a fresh one with ``env``: ``argv`` (default: this process's
    own, ``sys.orig_argv``) run by this Python. Never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv or sys.orig_argv, env)


@contextlib.contextmanager
def expandable_segments(unapplied: dict):
    """While the block runs, ``PYTORCH_CUDA_ALLOC_CONF`` asks CUDA's caching allocator for
    expandable segments (before the script's first CUDA allocation: it reads the setting
    when CUDA starts); ``unapplied`` says ``no CUDA`` without one, ``too late`` where CUDA has
    started already."""
    if not torch.cuda.is_available():
        unapplied["expandable-segments"] = "no CUDA"
        yield
        return
    if torch.cuda.is_initialized():
        unapplied["expandable-segments"] = "too late"
    with environ_set(CUDA_ALLOC_CONF, _expandable(os.environ.get(CUDA_ALLOC_CONF))):
        yield


def _expandable(conf: str | None) -> str:
    """``conf`` (PyTorch's comma-separated allocator settings) with expandable segments on."""
    kept = [s for s in (conf or "").split(",") if s and not s.startswith("expandable_segments")]
    return ",".join([*kept, EXPANDABLE])
