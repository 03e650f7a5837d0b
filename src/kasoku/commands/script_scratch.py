"""The scratch folder an A/B side of a script runs in (``kasoku.commands.script_ab``): each
side is a fresh run of the user's script, and without it every side would repeat the script's
side effects in the user's folder (a logger's ``lightning_logs/version_N`` per side, its
checkpoints, its prints to files).

A module of its own: the folder is file-system work, apart from the rounds and the advice.

The choice: the side's working directory is a fresh temporary folder that mirrors the user's
(the folder kasoku was started from) with links, removed after the side. Every entry of the
user's folder is a symbolic link to it, so the script's relative paths to its inputs resolve
as before (``data/train.csv``, ``config.yaml``, its own modules); a file the script creates
lands in the scratch folder. A directory small enough (``MIRROR_ENTRIES`` entries under it,
all such directories together) is mirrored instead -- real folders, their files linked -- so
that a new file in an existing output folder (``lightning_logs/version_7``) lands there too;
a larger one (a data set, a virtual environment) is linked whole, as mirroring it would cost
more than the side. Not covered: a file the script overwrites in place (``open(path, "w")`` on
a linked file writes through the link) or writes into a large folder, and paths that climb
above the folder (``../data``): a command whose arguments climb runs in the user's folder, as
before. Copying the folder instead would cost a data set's size per side; an overlay file
system needs privileges a user's machine may not grant.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MIRROR_ENTRIES = 2000
"""Entries (files and folders) mirrored in all; a folder with more under it is linked whole."""


@contextmanager
def scratch_folder(user: Path | None = None, entries: int = MIRROR_ENTRIES) -> Iterator[Path]:
    """A fresh temporary folder mirroring ``user`` (default: the working directory) with
    links, as the module doc says; removed with all it holds on exit (the links only, never
    what they point to)."""
    user = Path(user or Path.cwd()).resolve()
    with tempfile.TemporaryDirectory(prefix="kasoku-cwd-") as folder:
        budget = entries
        for entry in sorted(os.scandir(user), key=lambda e: e.name):
            target = Path(folder) / entry.name
            size = _entries(entry.path, budget) if entry.is_dir(follow_symlinks=False) \
                else budget + 1
            if size <= budget:
                budget -= size
                target.mkdir()
                _mirror(Path(entry.path), target)
            else:
                target.symlink_to(entry.path)
        yield Path(folder)


def climbs(args) -> bool:
    """Whether a command's argument names a path above its folder (``../data``)."""
    return any(part == ".." for arg in args for part in Path(arg).parts)


def _entries(path: str, limit: int) -> int:
    """The entries under ``path`` (links not followed), counted to just past ``limit``; an
    unreadable folder counts as past it (it is linked, not mirrored)."""
    count = 0
    try:
        for _, dirs, files in os.walk(path, onerror=_raise):
            count += len(dirs) + len(files)
            if count > limit:
                break
    except OSError:
        return limit + 1
    return count


def _raise(error: OSError) -> None:
    raise error


def _mirror(src: Path, dst: Path) -> None:
    """``dst`` (made) holds ``src``'s folders as folders and the rest as links to it."""
    for entry in os.scandir(src):
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            target.mkdir()
            _mirror(Path(entry.path), target)
        else:
            target.symlink_to(entry.path)
