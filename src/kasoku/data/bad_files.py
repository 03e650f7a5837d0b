"""Bad input files: one rule for what is bad and why, for every loader, and the list of those a
loader skipped.

Every loader reads a file through the same checks before, or instead of, decoding it, so Pillow
(which decodes a truncated JPEG or refuses it, depending on ``ImageFile.LOAD_TRUNCATED_IMAGES``)
and the GPU decoders (nvJPEG decodes what is there) skip the same files with the same reason:

``empty``
    zero bytes.
``truncated``
    a JPEG (bytes ``FF D8 FF`` first) whose bytes do not end with the end-of-image marker
    ``FF D9``, or a PNG that does not end with its ``IEND`` chunk; NUL bytes after the end
    (block padding) are allowed. Data appended after the end marker counts as truncated too:
    telling it apart would mean parsing the whole file.
``not an image``
    Pillow recognizes no image format in it (a text file named ``.jpg``).
``corrupt: <error>``
    recognized, but the decoder fails (``<error>``: what it said).
``too large: <error>``
    more pixels than Pillow's decompression-bomb limit allows.
``unreadable: <error>``
    the file cannot be read (permissions, an I/O error, gone).

``BadFileList`` keeps what a loader skipped (one ``BadFileRecord`` per path, in the order met,
safe across threads); ``BadFileWriter`` appends such records to a JSON-lines file
(``bad_files.jsonl`` of a training run, of ``data bench``), one line per path, also when
several processes append to it.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from kasoku.core.errors import DataError, warn_once
from kasoku.core.flags import flag

try:
    import fcntl
except ImportError:  # not POSIX: one process per file
    fcntl = None

BAD_FILES = "bad_files.jsonl"
"""The file a run (``kasoku train``, ``kasoku data bench``) lists its bad files in."""
EMPTY, TRUNCATED, NOT_AN_IMAGE = "empty", "truncated", "not an image"

_JPEG_START, _JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"
_PNG_START, _PNG_END = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"
_TAIL_BYTES = 256  # read from the end at a time while skipping NUL padding

_HINTS = {EMPTY: "the file has zero bytes",
          TRUNCATED: "the file stops before its image ends (a JPEG must end with its "
                     "end-of-image marker FF D9, a PNG with its IEND chunk): an interrupted "
                     "copy or download",
          NOT_AN_IMAGE: "no image format is recognized in it"}


class BadFile(DataError):
    """An input file that is no usable image: ``path`` and ``reason`` (one of the module
    docstring's). The message names both and says what to do."""

    def __init__(self, path, reason: str):
        self.path, self.reason = str(path), reason
        hint = _HINTS.get(reason)
        super().__init__(f"{path}: {reason}" + (f" ({hint})" if hint else "")
                         + "; replace or delete it")

    def __reduce__(self):  # pickled by loader worker processes
        return type(self), (self.path, self.reason)


def truncation(data, path) -> None:
    """``BadFile`` (``empty``, ``truncated``) when the bytes ``data`` (``bytes``, a
    ``memoryview``, a 1-D uint8 numpy array) break the module's rule; else nothing. Reads only
    the first bytes and the last ones (NUL padding skipped), not the whole file."""
    size = len(data)
    if size == 0:
        raise BadFile(path, EMPTY)
    head = bytes(data[:len(_PNG_START)])
    end = _JPEG_END if head.startswith(_JPEG_START) else \
        _PNG_END if head.startswith(_PNG_START) else None
    if end is None:
        return
    stop = size  # after the last byte that is not NUL padding
    while stop > 0:
        chunk = bytes(data[max(0, stop - _TAIL_BYTES):stop])
        kept = chunk.rstrip(b"\0")
        stop -= len(chunk) - len(kept)
        if kept:
            break
    if bytes(data[max(0, stop - len(end)):stop]) == end:
        return
    raise BadFile(path, TRUNCATED)


def check_file(path) -> None:
    """``truncation`` for a file a decoder reads itself (nvImageCodec): reads its first and last
    few hundred bytes. ``BadFile`` (``unreadable: ...``) when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= 2 * _TAIL_BYTES:
                data = f.read()
            else:
                head = f.read(len(_PNG_START))
                f.seek(size - _TAIL_BYTES)
                data = head + f.read()
                if not data[len(head):].rstrip(b"\0"):  # longer padding: look past it all
                    f.seek(0)
                    data = f.read()
    except OSError as exc:
        raise unreadable(path, exc) from exc
    truncation(data, path)


def read_checked(path) -> bytes:
    """The bytes of ``path`` after the module's rule (``BadFile`` for an empty, truncated or
    unreadable file): what every Pillow decode reads."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise unreadable(path, exc) from exc
    truncation(data, path)
    return data


def unreadable(path, exc: OSError) -> BadFile:
    return BadFile(path, f"unreadable: {exc.strerror or type(exc).__name__}")


def decode_failure(path, exc: Exception) -> BadFile:
    """The ``BadFile`` for Pillow's exception ``exc`` decoding ``path``: ``not an image`` when it
    recognized no format, ``too large: ...`` past its pixel limit, else ``corrupt: ...``."""
    if isinstance(exc, UnidentifiedImageError):
        return BadFile(path, NOT_AN_IMAGE)  # its message holds an address: not repeatable
    kind = "too large" if isinstance(exc, Image.DecompressionBombError) else "corrupt"
    return BadFile(path, f"{kind}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class BadFileRecord:
    path: str
    reason: str


class BadFileList:
    """The bad files a loader skipped: one ``BadFileRecord`` per path, in the order they were
    met; ``add`` is safe from several threads. The first one added with ``warn`` is warned
    about (once), naming ``listed_in``, where a run lists them all, when that is set; the
    others are only added. ``len``, iteration (the records) and ``in`` (a path) work as for a
    list."""

    def __init__(self):
        self._records: list[BadFileRecord] = []
        self._paths: set[str] = set()
        self._lock = threading.Lock()
        self._warned = False  # the first file added with warn, not the first added
        self.listed_in: str | None = None
        """Where the run writes the list (a path, as text), for the first warning."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]  # locks do not pickle; a worker process gets its own
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, path, reason: str, warn: bool = True) -> bool:
        """Record ``path`` (skipped for ``reason``); False when it was already recorded.
        ``warn=False``: the caller has said it already (a text corpus's files left out)."""
        path = str(path)
        with self._lock:
            if path in self._paths:
                return False
            self._paths.add(path)
            self._records.append(BadFileRecord(path, reason))
            first, self._warned = warn and not self._warned, self._warned or warn
        if first:
            where = f"every bad file is listed, with its reason, in {self.listed_in}" \
                if self.listed_in else "later bad files are counted, not warned about one by one"
            warn_once(f"skipping bad file {path} ({reason}): its samples are replaced by the next "
                      f"good image; {where} ({flag('data.strict')} makes a bad file an error)")
        return True

    def since(self, start: int) -> list[BadFileRecord]:
        """The records added after the first ``start``."""
        with self._lock:
            return self._records[start:]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(self.since(0))

    def __contains__(self, path) -> bool:
        return str(path) in self._paths


class BadFileWriter:
    """Appends bad-file lines to the JSON-lines file ``path`` (one object per line: ``path``,
    made absolute, ``reason`` and what the caller adds): ``append`` writes each path not yet in
    the file and flushes, so a crash loses none already written. Several processes may append
    to one file (the workers of a data-parallel run): each append holds an exclusive lock on
    it (POSIX) and first reads what the others added."""

    def __init__(self, path):
        self.path = Path(path)
        self._known: set[str] = set()
        self._read_to = 0

    def append(self, lines: list[dict]) -> int:
        """Write those of ``lines`` (each with ``path``) whose path the file does not hold;
        returns how many were written."""
        with open(self.path, "a+", encoding="utf-8") as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
            self._catch_up(f)
            new = []
            for line in lines:
                # Absolute: the list outlives the directory the run was started from.
                line = dict(line, path=os.path.abspath(line["path"]))
                if line["path"] not in self._known:
                    self._known.add(line["path"])
                    new.append(json.dumps(line) + "\n")
            if new:
                f.write("".join(new))
                f.flush()
            self._read_to = f.tell()
        return len(new)

    def count(self) -> int:
        """How many bad files the file lists (those other processes wrote included)."""
        if self.path.is_file():
            with open(self.path, encoding="utf-8") as f:
                if fcntl is not None:
                    fcntl.flock(f, fcntl.LOCK_SH)
                self._catch_up(f)
        return len(self._known)

    def _catch_up(self, f) -> None:
        f.seek(self._read_to)
        for line in f:
            try:
                self._known.add(json.loads(line)["path"])
            except (ValueError, KeyError, TypeError):  # a line cut by a crash, or not ours
                warn_once(f"{self.path}: a line that is not a bad-file record is ignored")
        self._read_to = f.tell()

    def watch(self, loader) -> BadFileWriter:
        """Name this file in the first warning ``loader`` gives about a bad file (where it
        keeps a list, ``loader.bad_file_list``); returns ``self``."""
        bad = getattr(loader, "bad_file_list", None)
        if bad is not None:
            bad.listed_in = str(self.path)
        return self

    def write_skipped(self, loader, /, **fields) -> int:
        """Append the bad files ``loader`` skipped, ``fields`` added to each line; returns how
        many it skipped so far (0 for a loader that keeps no list)."""
        bad = getattr(loader, "bad_file_list", None)
        if bad is None:
            return 0
        records = bad.since(0)
        if records:
            self.append([{"path": r.path, "reason": r.reason, **fields} for r in records])
        return len(records)
