"""A byte-level BPE tokenizer trained on the corpus it tokenizes, as GPT-2's is (Radford et al.
2019): Hugging Face ``tokenizers`` (an optional dependency: ``pip install tokenizers``, the
``text`` extra) learns the merges offline, with GPT-2's byte-level pre-tokenizer and decoder
(every byte is a token to start from, so any text encodes and nothing is unknown).

``trained`` trains it once per corpus and vocabulary size on the corpus's training text (the
files before its last ``held_out`` of bytes: the validation tail, the last tenth of the tokens
at most, is not learnt from) and caches it as JSON beside the token files
(``kasoku.data.text.cache_dir``), named by a hash of those files (path, size, modification
time) and the vocabulary size; a second run loads it. The training is deterministic (the same
files make the same tokenizer in any process: the workers of a data-parallel run, a run whose
cache was cleared), and written atomically, so processes training at once agree.
``BPETokens`` is what ``kasoku.data.text.tokenize`` encodes with: its name (in the token file's
key) carries the tokenizer's, so another tokenizer never reads this one's token file.

The vocabulary: ``vocab_size`` ids (fewer where the text has too few pairs to merge), the 256
bytes, ``DOC_END`` (id 0, written after each document) and the merges learnt.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from kasoku.core.errors import ConfigError, DataError
from kasoku.data.text import (
    cache_dir,
    check_files,
    files_key,
    make_cache_dir,
    read_texts,
    write_atomic,
)

MIN_VOCAB = 258
"""The 256 bytes, the end-of-document token and one merge."""
DOC_END = "<|endoftext|>"
"""GPT-2's end-of-text token, written after each document (id 0: the first one trained)."""
INSTALL = "pip install tokenizers"


def import_tokenizers(needed_by: str):
    """The ``tokenizers`` module; ``ConfigError`` saying how to install it when missing."""
    try:
        import tokenizers  # deferred: an optional dependency, and a second of import
    except ImportError as exc:
        raise ConfigError(f"{needed_by} needs Hugging Face tokenizers: {INSTALL}") from exc
    return tokenizers


class BPETokens:
    """A trained tokenizer (``tokenizers.Tokenizer``, saved as ``path``) as
    ``kasoku.data.text.tokenize`` uses one."""

    def __init__(self, tokenizer, path: Path):
        self.tokenizer, self.path = tokenizer, Path(path)
        self.vocab_size = tokenizer.get_vocab_size()
        self.dtype = "uint16" if self.vocab_size <= 1 << 16 else "int32"
        self.name = self.path.stem  # bpe-VOCAB-KEY: the tokenizer's own key
        self.doc_end = tokenizer.token_to_id(DOC_END)

    def encode_batch(self, texts: list[bytes]) -> list[bytes]:
        """The token ids of each text, ``DOC_END`` after it, as ``dtype`` bytes; the batch is
        encoded in parallel (the library's threads, ``RAYON_NUM_THREADS``)."""
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: half the time.
        import numpy as np  # deferred: as the tokenizer, only where text is tokenized
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode([t.decode("utf-8") for t in texts], add_special_tokens=False)
        end = [self.doc_end]
        return [np.asarray(e.ids + end, dtype=self.dtype).tobytes() for e in encodings]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def trained(root: Path, files: list[Path], vocab_size: int,
            cache: Path | None = None, held_out: float = 0.1,
            needed_by: str = "a BPE tokenizer") -> BPETokens:
    """The BPE tokenizer of ``vocab_size`` ids for ``files`` (under ``root``): the cached one
    when there is one for exactly these training files and size, else one trained now (on the
    files before the last ``held_out`` of the bytes, at least one) and cached. The training
    says so on stderr, with the seconds it took."""
    tokenizers = import_tokenizers(needed_by)
    check_files(root, files)
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"a BPE vocabulary of {vocab_size:,} tokens learns no merges: give "
                          f"{MIN_VOCAB:,} or more")
    learn = training_files(files, held_out)
    folder = cache_dir(cache)
    path = folder / f"bpe-{vocab_size}-{files_key(learn, 'bpe', vocab_size)}.json"
    if path.is_file():
        try:
            return BPETokens(tokenizers.Tokenizer.from_file(str(path)), path)
        except Exception:  # noqa: BLE001 -- a damaged cache entry is trained again
            pass
    make_cache_dir(folder)
    print(f"training a BPE tokenizer of {vocab_size:,} tokens on {len(learn)} of the "
          f"{len(files)} files of {root} (once; kept in {path})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    tokenizer = _train(tokenizers, learn, vocab_size)
    if tokenizer.get_vocab_size() < MIN_VOCAB:
        raise DataError(f"{root}: its text is too short to learn any BPE merges; give more "
                        f"text, or tokenize it byte-level")
    write_atomic(path, tokenizer.to_str())
    print(f"trained the BPE tokenizer in {time.perf_counter() - start:.1f} s "
          f"({tokenizer.get_vocab_size():,} tokens)", file=sys.stderr, flush=True)
    return BPETokens(tokenizer, path)


def training_files(files: list[Path], held_out: float) -> list[Path]:
    """The files before the last ``held_out`` of the bytes of ``files`` (at least one)."""
    sizes = [f.stat().st_size for f in files]
    budget, total, kept = (1 - held_out) * sum(sizes), 0, 0
    for size in sizes:
        if total + size > budget:
            break
        total, kept = total + size, kept + 1
    return files[:max(1, kept)]


def _train(tokenizers, files: list[Path], vocab_size: int):
    from tokenizers import decoders, models, pre_tokenizers, trainers  # deferred: optional
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DOC_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = (t.decode("utf-8") for _, chunk in read_texts(files) for t in chunk)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(files))
    return tokenizer
