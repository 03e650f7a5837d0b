"""Run folders that never lose work.

A training run writes its log, snapshots and plots into one folder. A new run never writes
into a folder that holds another run's files: it is refused with a message offering to resume
it, to write elsewhere, or to overwrite it. By default each run gets a fresh folder
``runs/train-WORKLOAD-YYYYMMDD-HHMMSS`` (a ``-2``, ``-3``... suffix when two start in the same
second), so running the same command twice keeps both runs.
"""
from __future__ import annotations

import datetime as dt
import errno
import os
import shutil
import tempfile
from pathlib import Path

from kasoku.core import snapshot_names
from kasoku.core.errors import ConfigError, warn_once
from kasoku.core.flags import flag
from kasoku.core.snapshot_names import is_sharded_snapshot, snapshots

AUTO = "auto"
"""``--resume auto``: resume from the output folder's snapshot when it has one, else start
fresh (what a restarted worker of a distributed job needs)."""
OUTPUT_ROOT = Path("runs")
"""Where every kasoku command writes by default (training runs, bench and data bench results)."""
SNAPSHOT = snapshot_names.LATEST
"""The snapshot a run writes by default (the names are said in ``kasoku.core.snapshot_names``,
where the launcher, a layer below, reads them too)."""
RUN_FILES = ("log.jsonl", "log.failed.jsonl", snapshot_names.FILES, snapshot_names.SHARDED,
             "loss.png", "accuracy.png", "bad_files.jsonl")
"""What a training run writes into its folder (glob patterns; ``snapshot_*.dcp`` are folders,
a sharded run's snapshots): what marks a folder as holding a run, and what ``overwrite``
removes (nothing else in the folder is touched)."""


class SnapshotError(ValueError):
    """A snapshot file is missing, truncated or not a kasoku snapshot. (Here, beside the run
    folder's files, rather than in ``snapshot``: this module loads without torch.)"""


def default_out(name: str, root: Path = OUTPUT_ROOT, now: dt.datetime | None = None,
                kind: str = "train") -> Path:
    """A new, empty folder ``root/KIND-NAME-YYYYMMDD-HHMMSS`` (created here, so two runs
    started in the same second get two folders)."""
    stamp = f"{(now or dt.datetime.now()):%Y%m%d-%H%M%S}"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "run"
    base = Path(root) / f"{kind}-{safe}-{stamp}"
    for k in range(1, 1000):
        path = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            path.mkdir(parents=True)
            _MADE.append(path)
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(_cannot_create(root, exc)) from None
    raise ConfigError(f"{base}: a thousand runs started in this second; give {flag('train.out')}")


_MADE: list[Path] = []
"""The folders ``default_out`` made in this process (``remove_empty_made`` reads them)."""


def remove_empty_made() -> None:
    """Remove each folder ``default_out`` made in this process that is still empty (the
    command failed before writing, or was a side of a lever's try that writes nothing):
    a new folder is kasoku's, and an empty one tells the user nothing."""
    while _MADE:
        try:
            _MADE.pop().rmdir()  # refused unless empty: nothing written is ever removed
        except OSError:
            pass


def run_files(folder: Path) -> list[Path]:
    """The files of a run in ``folder`` (``RUN_FILES``), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted({p for pattern in RUN_FILES for p in folder.glob(pattern)
                   if p.is_file() or is_sharded_snapshot(p)})


def saved_line(folder: Path) -> str:
    """One line saying where a finished run's log, plots and snapshots are in ``folder``
    (those it holds)."""
    folder = Path(folder)
    found = {p.name for p in run_files(folder)}
    kinds = (("log", [n for n in ("log.jsonl",) if n in found]),
             ("plots", sorted(n for n in found if n.endswith(".png"))),
             ("snapshot", sorted(n for n in found if n.startswith("snapshot_"))),
             ("bad files", [n for n in ("bad_files.jsonl",) if n in found]))
    said = "; ".join(f"{kind} {', '.join(names)}" for kind, names in kinds if names)
    return f"saved in {folder}: {said or 'nothing'}"


def check_writable(out: Path, flag: str = flag("train.out"), what: str = "the command's output",
                   advice: str = "choose a folder you can write to") -> None:
    """Refuse (``ConfigError``, one line saying what to do) an output folder ``out`` that
    cannot take files: a file, a path under a file, or a folder, ``out`` itself or else its
    nearest existing parent (where it would be created), in which creating a file fails
    (read-only file system, no permission). Probed by creating and removing a file there:
    ``os.access`` says yes on a read-only mount, and to root. Creates nothing that stays.
    The message names ``flag``, ``what`` goes there, and ends with ``advice``."""
    out = Path(out)
    target = folder = Path(os.path.abspath(out))
    # os.path.exists, not Path.exists: a parent without search permission is "absent" here
    # (Path.exists raises), and the walk goes on up to the folder that refuses the probe.
    while not os.path.exists(folder) and folder.parent != folder:
        folder = folder.parent
    if not os.path.isdir(folder):
        where = "is a file" if folder == target else f"is under {folder}, a file"
        raise ConfigError(f"{flag} {out} {where}; give a folder for {what}")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kasoku-write-check-")
    except OSError as exc:
        why = exc.strerror or str(exc)
        if folder == target:
            raise ConfigError(f"{flag} {out}: cannot write in the folder ({why}); {advice}"
                              ) from None
        raise ConfigError(f"{flag} {out}: cannot create the folder ({folder}: {why}); "
                          f"{advice}") from None
    os.close(fd)
    os.unlink(probe)


def make_out_dir(out: Path, what: str = "the run's log, snapshots and plots") -> Path:
    """``out`` as a folder, created if missing: what every command writes into. A file there, or
    a folder that cannot be created or written in (``check_writable``), is a ``ConfigError``
    saying so, before any work starts."""
    out = Path(out)
    check_writable(out, what=what)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(_cannot_create(out, exc)) from None
    return out


def out_or_new(out: Path | None, name: str, kind: str, what: str) -> Path:
    """A command's output folder: ``--out`` (``make_out_dir``, ``what`` naming what goes
    there), else a new ``runs/KIND-NAME-DATE-TIME`` (``default_out``)."""
    return make_out_dir(out, what) if out is not None else default_out(name, kind=kind)


def prepare_out(out: Path, overwrite: bool = False, advice: str | None = None) -> Path:
    """Make ``out`` ready for a new run: created if missing; refused (``ConfigError``) when it
    is a file, cannot be created, or holds another run's files, unless ``overwrite``, which
    removes those files (and only those). ``advice``: what the refusal offers (default: the
    command line's options)."""
    out = make_out_dir(out)
    previous = run_files(out)
    if previous and not overwrite:
        names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        if advice is None:
            offer = f"continue it with {flag('train.resume')} {out}, " \
                if any(p.name.startswith("snapshot_") for p in previous) else ""
            advice = (f"{offer}give a new {flag('train.out')}, or add {flag('train.overwrite')} to "
                      "replace it")
        raise ConfigError(f"{out} holds a previous run ({names}); {advice}")
    for path in previous:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def refuse_a_run(out: Path, what: str) -> None:
    """Refuse (``ConfigError``, saying what to do) an ``out`` that holds a training run's
    files: a command that is not ``train`` writes ``what`` into a folder of its own, never
    beside a run's log and snapshots."""
    previous = run_files(out)
    if previous:
        names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        raise ConfigError(f"{flag('train.out')} {out} holds a training run ({names}); give "
                          f"{what} a folder of its own ({flag('train.out')} NEW_DIR), or no "
                          f"{flag('train.out')} for a new one under {OUTPUT_ROOT}/")


def find_snapshot(path) -> Path:
    """The snapshot a ``--resume PATH`` means: PATH itself when it is a file or a sharded
    snapshot's folder; in a run folder its ``snapshot_latest.pt``, else its newest
    ``snapshot_*.pt`` or ``snapshot_*.dcp``. ``SnapshotError`` when there is none."""
    path = Path(path)
    if path.is_file() or is_sharded_snapshot(path):
        return path
    if path.is_dir():
        latest = path / SNAPSHOT
        if latest.is_file():
            return latest
        found = sorted(snapshots(path), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
        raise SnapshotError(f"{flag('train.resume')} {path}: the folder holds no snapshot "
                            "(snapshot_*.pt); give a run folder that has one, or train without "
                            f"{flag('train.resume')}")
    raise SnapshotError(f"{flag('train.resume')} {path}: no such file or folder; give a run folder "
                        "or a snapshot_*.pt file written by a previous run, or train without "
                        f"{flag('train.resume')}")


def _cannot_create(out: Path, exc: OSError) -> str:
    why = exc.strerror or str(exc)
    hint = "choose a folder you can write to" if exc.errno in (errno.EACCES, errno.EPERM,
                                                             errno.EROFS, errno.ENOENT) \
        else "choose another folder"
    return f"{flag('train.out')} {out}: cannot create the folder ({why}); {hint}"


def resolve_run(workload_name: str, out: Path | None, resume, overwrite: bool
                ) -> tuple[Path, Path | None]:
    """``(the run folder, the snapshot to resume from or None)`` for ``--out``, ``--resume``
    (None, ``auto``, a run folder or a snapshot file) and ``--overwrite``; the folder exists
    afterwards and holds no other run's files."""
    if resume == AUTO:
        if out is None:
            raise ConfigError(f"{flag('train.resume')} auto continues the run in "
                              f"{flag('train.out')} DIR when DIR holds a snapshot; give "
                              f"{flag('train.out')} DIR")
        if any(p.name.startswith("snapshot_") for p in run_files(out)):
            return Path(out), find_snapshot(out)
        if run_files(out):
            warn_once(f"{flag('train.resume')} auto: {out} holds no snapshot, so the run starts "
                      "there anew; the files of the run that left none are replaced")
        return prepare_out(out, overwrite=True), None
    if resume is not None:
        snapshot = find_snapshot(resume)
        if out is None or Path(out).resolve() == snapshot.parent.resolve():
            return snapshot.parent, snapshot  # the run goes on in its own folder
        return prepare_out(out, overwrite), snapshot  # a new folder continues it
    if out is None:
        return default_out(workload_name), None
    return prepare_out(out, overwrite), None


def new_folders(out: Path) -> list[Path]:
    """``out`` and each of its parents that do not exist yet, deepest first: what making
    ``out`` creates, for ``remove_empty`` should the command be stopped before it wrote there."""
    created, path = [], Path(out).absolute()
    while not path.exists() and path != path.parent:
        created.append(path)
        path = path.parent
    return created


def remove_empty(folders: list[Path]) -> bool:
    """Remove each of ``folders`` (deepest first, as ``new_folders`` lists them) that is an
    empty folder, stopping at the first that is not; whether the first was removed."""
    for i, folder in enumerate(folders):
        try:
            folder.rmdir()  # only an empty folder: never a file of anyone's
        except OSError:
            return i > 0
    return bool(folders)
