"""What the workers of a launch tell the launching process, and which worker it blames.

The elastic launcher reports every worker of a failed group as failed, the ones it stopped
itself included, and knows a worker's error only if the worker recorded it in the launcher's
error file. kasoku's workers leave notes instead, in a folder the launching process names in
``KASOKU_JOB_DIR`` (``note``): ``failed`` (their one error line, and whether it is only the
loss of another worker: a reset connection, a collective that timed out), ``signalled`` (a
SIGINT/SIGTERM reached them: the launcher stopping them, or a person) and ``interrupted``
(stopped by a signal after the snapshot was written). ``blame`` then names the worker that
failed on its own: an error of its own first (the earliest), then a worker that left no note at
all (killed from outside: SIGKILL, the out-of-memory killer, a crash in C), then the earliest
lost peer; never one the launcher stopped.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from kasoku.distributed.world import restart_count

JOB_DIR_ENV = "KASOKU_JOB_DIR"

PEER_LOSS = ("timed out", "timeout", "connection reset", "connection closed",
             "connection refused", "broken pipe", "closed by peer")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is what a worker sees when another worker stopped: a collective that
    failed on its connection or timed out."""
    text = str(exc).lower()
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or \
        any(p in text for p in PEER_LOSS)


def note(kind: str, **fields) -> bool:
    """In a worker: leave a note of ``kind`` (failed, signalled, interrupted) for the
    launching process; False when there is none to tell (not started by ``launch``)."""
    folder = os.environ.get(JOB_DIR_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    path = Path(folder) / f"attempt{restart_count()}-rank{rank}-{kind}.json"
    if path.exists() and kind == "signalled":  # the first signal is the one that counts
        return True
    try:
        path.write_text(json.dumps({"time_ns": time.time_ns(), **fields}))
    except OSError:
        return False
    return True


def read_notes(folder: Path, kind: str) -> dict[int, dict]:
    """The notes of ``kind`` of the latest attempt that left any, by rank."""
    found: dict[int, dict[int, dict]] = {}
    for path in Path(folder).glob(f"attempt*-rank*-{kind}.json"):
        attempt, rank, _ = path.stem.split("-", 2)
        try:
            found.setdefault(int(attempt[7:]), {})[int(rank[4:])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
    return found[max(found)] if found else {}


def blame(failures: dict, folder: Path | None) -> tuple[int, object, str]:
    """``(rank, failure, why)`` of the worker that failed on its own among the launcher's
    ``failures`` (rank -> ``ProcessFailure``), from the workers' notes in ``folder``; ``why``
    is one line: its error, or how it ended without one."""
    failed = read_notes(folder, "failed") if folder else {}
    signalled = read_notes(folder, "signalled") if folder else {}

    def rank_of(item):
        rank, failure = item
        mine = failed.get(rank)
        code = failure.exitcode
        if mine and not mine.get("peer_lost"):
            return (0, mine["time_ns"], rank)
        if mine is None and rank not in signalled:
            # No word from it: it died at once. SIGTERM is the launcher's own stop, last.
            return (1, int(code == -signal.SIGTERM), rank)
        if mine:
            return (2, mine["time_ns"], rank)
        return (3, _error_file_time(failure), rank)

    rank, failure = min(failures.items(), key=rank_of)
    mine = failed.get(rank)
    if mine:
        return rank, failure, mine.get("line", "")
    code = failure.exitcode
    if code is not None and code < 0:
        name = _signal_name(-code)
        return rank, failure, (f"killed by {name} with no error of its own: stopped from "
                               f"outside kasoku (the out-of-memory killer, a scheduler, "
                               f"kill){'; a crash in native code' if name == 'SIGSEGV' else ''}")
    return rank, failure, "exited without an error of its own (see its output above)"


def how(code: int | None) -> str:
    """``exit code N``, ``signal N (NAME)`` or ``no exit code``."""
    if code is None:
        return "no exit code"
    return f"exit code {code}" if code >= 0 else f"signal {-code}, {_signal_name(-code)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _error_file_time(failure) -> float:
    path = getattr(failure, "error_file", "")
    return os.stat(path).st_mtime_ns if path and os.path.isfile(path) else float("inf")
