"""A folder of UTF-8 text tokenized once into a cached file of token ids.

Tokenization is byte-level by default (``BYTES``): a token is one byte of the UTF-8 text (256
ids), and the files are joined with ``DOC_END`` (the NUL byte, which text files do not hold)
between them. Another tokenizer (``kasoku.data.bpe``: a BPE tokenizer trained on the corpus)
is given as ``tokenize(..., tokenizer=)``: its name is part of the cache key, its token ids
are written as its ``dtype`` (uint16 up to 65,536 ids), and a corpus that takes a while to
tokenize says how far it has come (files done / total, ``kasoku.core.status_line``).

The token file is written once and reused: its name is a hash of the tokenizer and of every
file's path, size and modification time, so a changed, added or removed file makes a new one.
It is written under a temporary name in the cache folder and renamed into place, its
description (``.json``: counts and the files left out) after it, so a run stopped while
writing, or two processes writing at once, never leave a file that looks complete.

The cache folder: ``DataConfig.cache`` (``--data-cache DIR``), else ``$KASOKU_CACHE``, else
``$XDG_CACHE_HOME/kasoku``, else ``~/.cache/kasoku``.

A file that is not UTF-8 is a bad file by the rule every loader keeps
(``kasoku.data.bad_files``): left out of the corpus and counted in one warning (its path and
why in the description), or with ``strict`` an error naming it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kasoku.core.errors import DataError, warn_once
from kasoku.core.flags import flag
from kasoku.core.status_line import StatusLine
from kasoku.data.bad_files import BadFile

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
"""The files of a ``--data`` folder read as text (any depth; hidden files and folders left
out)."""
TOKENIZER = "bytes"
VOCAB_SIZE = 256
"""Token ids the byte-level tokenizer makes."""
DOC_END = 0
"""The token written after every file."""
FORMAT = 1
"""The token file's layout (part of its key: a new layout never reads an old file)."""
CACHE_ENV = "KASOKU_CACHE"
ITEMSIZE = {"uint8": 1, "uint16": 2, "int32": 4}
"""The token files' id types and their bytes."""
CHUNK_BYTES = 1 << 20
"""Text handed to the tokenizer at once (whole files, at least one): a BPE tokenizer encodes
a batch in parallel, and progress is said between batches."""
PROGRESS_AFTER_S = 2.0
"""Tokenizing says how far it has come once it has taken this long (bytes: never, on the
standard library)."""


class Tokenizer(Protocol):
    """What ``tokenize`` needs of a tokenizer: a ``name`` (in the cache key: another tokenizer
    makes another file), the ids' ``dtype`` (an ``ITEMSIZE`` key), its ``vocab_size``, and
    ``encode_batch``: UTF-8 texts to their token ids as ``dtype`` bytes, each followed by the
    tokenizer's end-of-document token."""
    name: str
    dtype: str
    vocab_size: int

    def encode_batch(self, texts: list[bytes]) -> list[bytes]: ...


class ByteTokens:
    """Byte-level: a token is a byte, ``DOC_END`` after each document."""
    name, dtype, vocab_size = TOKENIZER, "uint8", VOCAB_SIZE

    def encode_batch(self, texts: list[bytes]) -> list[bytes]:
        return [text + bytes([DOC_END]) for text in texts]


BYTES = ByteTokens()


@dataclass(frozen=True)
class Corpus:
    """A tokenized text folder: ``tokens`` (a cache file of ``n_tokens`` ids of ``dtype``, from
    a tokenizer of ``vocab_size`` ids), ``n_files`` read, ``skipped``: ``[path, reason]`` of
    the files left out."""
    root: str
    tokens: Path
    n_tokens: int
    n_files: int
    skipped: tuple[tuple[str, str], ...] = ()
    dtype: str = "uint8"
    vocab_size: int = VOCAB_SIZE


def cache_dir(cache: Path | None = None) -> Path:
    """The folder for derived data (the module docstring says which)."""
    if cache is not None:
        return Path(cache).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kasoku"


def text_files(root: Path) -> list[Path]:
    """The ``TEXT_SUFFIXES`` files under ``root``, sorted by path."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{flag('data.root')} {root}: no such folder; give a folder of UTF-8 text "
                        f"files ({', '.join(TEXT_SUFFIXES)})")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(folder) / f for f in files
                  if not f.startswith(".") and f.lower().endswith(TEXT_SUFFIXES)]
    return sorted(found)


def stdlib_files() -> tuple[Path, list[Path]]:
    """The Python standard library's own ``.py`` files (installed packages left out): a real
    corpus every machine with Python has, offline. Returns its folder and the files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return root, sorted(found)


def check_files(root: Path, files: list[Path]) -> None:
    """``DataError`` when ``files`` is empty."""
    if not files:
        raise DataError(f"{root} holds no text files ({', '.join(TEXT_SUFFIXES)}, at any "
                        f"depth); give a folder of UTF-8 text")


def files_key(files: list[Path], *parts) -> str:
    """A hash of ``parts`` and of every file's path, size and modification time (what a cache
    entry made of these files is named by)."""
    listing = [(os.path.abspath(f), f.stat()) for f in files]  # one key from any folder
    return hashlib.sha256(json.dumps(
        [FORMAT, *parts, [(p, s.st_size, s.st_mtime_ns) for p, s in listing]]
    ).encode()).hexdigest()[:24]


def tokenize(root: Path, files: list[Path], cache: Path | None = None,
             strict: bool = False, tokenizer: Tokenizer = BYTES) -> Corpus:
    """``files`` (under ``root``) as a ``Corpus`` of ``tokenizer``'s ids: the cached token
    file when there is one for exactly these files and this tokenizer, else one written now.
    ``DataError`` when none of them holds text."""
    check_files(root, files)
    key = files_key(files, tokenizer.name)
    folder = cache_dir(cache)
    data, meta = folder / f"tokens-{key}.{tokenizer.name}", folder / f"tokens-{key}.json"
    corpus = _cached(data, meta)
    if corpus is None:
        corpus = _write(root, files, folder, data, meta, strict, tokenizer)
    if corpus.skipped:
        if strict:  # a cache written without --strict-data kept the files it left out
            raise BadFile(*corpus.skipped[0])
        path, reason = corpus.skipped[0]
        n = len(corpus.skipped)
        warn_once(f"{n} of {n + corpus.n_files} text files under {root} are left out "
                  f"(first: {path}: {reason}); all are listed in {meta} ({flag('data.strict')} "
                  f"makes one an error)")
    if corpus.n_tokens <= corpus.n_files:
        raise DataError(f"{root}: its {corpus.n_files} UTF-8 text files are empty; give a "
                        f"folder of UTF-8 text")
    return corpus


def _cached(data: Path, meta: Path) -> Corpus | None:
    try:
        info = json.loads(meta.read_text())
        dtype = info.get("dtype", "uint8")  # files written before there was another
        if data.stat().st_size != info["n_tokens"] * ITEMSIZE[dtype]:
            return None
    except (OSError, ValueError, KeyError):
        return None
    return Corpus(info["root"], data, info["n_tokens"], info["n_files"],
                  tuple(tuple(s) for s in info["skipped"]), dtype,
                  info.get("vocab_size", VOCAB_SIZE))


def make_cache_dir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot make the cache folder {folder} ({exc.strerror}); give a "
                        f"writable one with {flag('data.cache')} DIR or ${CACHE_ENV}") from exc


def _write(root: Path, files: list[Path], folder: Path, data: Path, meta: Path,
           strict: bool, tokenizer: Tokenizer) -> Corpus:
    make_cache_dir(folder)
    n_bytes, n_files, skipped = 0, 0, []
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=data.name, suffix=".tmp")
    start, status = time.monotonic(), None
    try:
        with os.fdopen(fd, "wb") as out:
            for done, texts in _chunks(files, strict, skipped):
                for ids in tokenizer.encode_batch(texts):
                    out.write(ids)
                    n_bytes += len(ids)
                n_files += len(texts)
                if status is None and time.monotonic() - start >= PROGRESS_AFTER_S:
                    status = StatusLine()
                if status is not None:
                    status.update(f"tokenizing {root} ({tokenizer.name}): {done}/{len(files)} "
                                  f"files")
        if status is not None:
            status.close()
        if n_files == 0:
            raise DataError(f"{root}: none of its {len(files)} text files is UTF-8 (first: "
                            f"{skipped[0][0]}: {skipped[0][1]}); give a folder of UTF-8 text")
        os.replace(tmp, data)
        n_tokens = n_bytes // ITEMSIZE[tokenizer.dtype]
        info = {"root": str(root), "tokenizer": tokenizer.name, "n_tokens": n_tokens,
                "n_files": n_files, "skipped": skipped, "dtype": tokenizer.dtype,
                "vocab_size": tokenizer.vocab_size}
        write_atomic(meta, json.dumps(info, indent=1))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return Corpus(str(root), data, n_tokens, n_files, tuple(skipped), tokenizer.dtype,
                  tokenizer.vocab_size)


def read_texts(files: list[Path], strict: bool = False, skipped: list | None = None):
    """``(files done, [UTF-8 texts])`` of ``files`` in chunks of about ``CHUNK_BYTES``; the
    files that are not UTF-8 left out (``[path, reason]`` appended to ``skipped``), or with
    ``strict`` a ``BadFile``."""
    return _chunks(files, strict, [] if skipped is None else skipped)


def _chunks(files: list[Path], strict: bool, skipped: list):
    texts, size = [], 0
    for i, f in enumerate(files):
        text = _read_text(f, strict)
        if isinstance(text, str):
            skipped.append((str(f), text))
        else:
            texts.append(text)
            size += len(text)
        if texts and (size >= CHUNK_BYTES or i == len(files) - 1):
            yield i + 1, texts
            texts, size = [], 0


def _read_text(path: Path, strict: bool) -> bytes | str:
    """The file's bytes when they are UTF-8 text, else the reason it is left out (a
    ``BadFile`` with ``strict``)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        reason = f"unreadable: {exc.strerror or type(exc).__name__}"
    else:
        try:
            raw.decode("utf-8")
            return raw
        except UnicodeDecodeError as exc:
            reason = f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}"
    if strict:
        raise BadFile(path, reason)
    return reason


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
