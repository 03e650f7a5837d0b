"""Next-token samples: windows of a token file (memory-mapped), and generated token sequences
of the same shapes.

A sample is ``(x, y)``: ``x`` the int64 ids of ``block_size`` consecutive tokens, ``y`` the
ids one position later (the next token at every position). ``token_datasets`` splits a corpus
(``kasoku.data.text``) into training windows and a validation tail; the training windows
start at an offset drawn per epoch from ``(seed, epoch)`` (``set_epoch``), so successive
epochs cut the text at other places while every process, and a resumed run, cut it alike.
"""
from __future__ import annotations

import numpy as np
import torch

from kasoku.core.errors import DataError
from kasoku.data.bad_files import BadFileList
from kasoku.data.base import ArrayDataset
from kasoku.data.text import Corpus

VAL_FRACTION = 0.1
MAX_VAL_WINDOWS = 512
"""The validation tail: a tenth of the tokens, at most this many windows (an evaluation of a
whole tenth of the standard library would take longer on a CPU than the training between)."""


class TokenWindows:
    """Windows ``[offset + i * block_size, ... + block_size]`` (``block_size + 1`` tokens: the
    input and, shifted by one, the target) of the token file ``path``, ``i`` from 0 to
    ``n_windows - 1``, within ``[start, start + span)`` (ids of ``dtype``: uint8 for bytes,
    uint16 or int32 for a BPE tokenizer's). With ``seed`` the offset is drawn
    from ``(seed, epoch)`` in ``[0, block_size)`` at each ``set_epoch``; without it, 0.

    The file is opened on first use in each process (a loader's worker gets the path, not a
    copy of the tokens)."""

    def __init__(self, path, start: int, span: int, block_size: int, seed: int | None = None,
                 name: str = "tokens", bad_files: BadFileList | None = None,
                 dtype: str = "uint8"):
        self.path, self.start, self.block_size, self.seed = str(path), start, block_size, seed
        self.dtype = dtype
        self.name = name
        self.bad_files = bad_files
        """The corpus's files left out (not UTF-8), for the run's ``bad_files.jsonl``."""
        # Room for the largest offset when the cut moves between epochs.
        room = span - (block_size if seed is not None else 1)
        self.n_windows = max(0, room // block_size)
        self.offset = 0
        self._tokens: np.ndarray | None = None
        if seed is not None:
            self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        if self.seed is not None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.offset = int(torch.randint(self.block_size, (1,), generator=g))

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, index: int):
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def get_batch(self, indices: torch.Tensor):
        indices = torch.as_tensor(indices, dtype=torch.int64).numpy()
        if len(indices) and (indices.min() < 0 or indices.max() >= self.n_windows):
            raise IndexError(f"{self.name}: index out of range for {self.n_windows} windows")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        first = self.start + self.offset + indices * self.block_size
        rows = self._tokens[first[:, None] + np.arange(self.block_size + 1)]
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _tokens=None)  # each process maps the file itself

    def __repr__(self) -> str:
        return (f"TokenWindows({self.name}, n={self.n_windows}, block={self.block_size}, "
                f"offset={self.offset})")


def token_datasets(corpus: Corpus, block_size: int, seed: int = 0
                   ) -> tuple[TokenWindows, TokenWindows]:
    """``(train, val)`` of ``corpus``: the validation tail (``VAL_FRACTION`` of the tokens, at
    most ``MAX_VAL_WINDOWS`` windows, cut at fixed places) and the training windows before
    it. ``DataError`` when the text is too short for both."""
    n = corpus.n_tokens
    val_tokens = min(int(n * VAL_FRACTION), MAX_VAL_WINDOWS * block_size + 1)
    left_out = BadFileList()  # said once by tokenize already: listed, not warned again
    for path, reason in corpus.skipped:
        left_out.add(path, reason, warn=False)
    train = TokenWindows(corpus.tokens, 0, n - val_tokens, block_size, seed=seed,
                         name="text-train", bad_files=left_out, dtype=corpus.dtype)
    val = TokenWindows(corpus.tokens, n - val_tokens, val_tokens, block_size, name="text-val",
                       dtype=corpus.dtype)
    if len(train) < 1 or len(val) < 1:
        raise DataError(f"{corpus.root}: its {n:,} tokens are too few for a training and a "
                        f"validation window of {block_size + 1} tokens (it needs about "
                        f"{int(2 * (block_size + 1) / VAL_FRACTION):,}); give more text")
    return train, val


FOLLOW_PROBABILITY = 0.75
"""In generated sequences, how often a token is the fixed successor of the one before it
(else drawn uniformly): learnable structure, so the loss falls as on real text."""


def synthetic_token_datasets(n_train: int, n_val: int, block_size: int, vocab_size: int,
                             seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, val)`` generated sequences of ``block_size + 1`` tokens: each token is, with
    ``FOLLOW_PROBABILITY``, the successor of the one before it under a permutation of the
    vocabulary drawn from ``seed``, else a uniform draw. Train and val are two ranges of one
    draw (one successor rule), as the synthetic images share their labelling rule."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab_size, generator=g)
    n = n_train + n_val
    seq = torch.empty(n, block_size + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(vocab_size, (n,), generator=g)
    follow = torch.rand(n, block_size, generator=g) < FOLLOW_PROBABILITY
    drawn = torch.randint(vocab_size, (n, block_size), generator=g)
    for k in range(block_size):  # sequential in k, vectorized over the sequences
        seq[:, k + 1] = torch.where(follow[:, k], successor[seq[:, k]], drawn[:, k])
    inputs, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return (ArrayDataset(inputs[:n_train], targets[:n_train], name="synthetic-tokens-train"),
            ArrayDataset(inputs[n_train:], targets[n_train:], name="synthetic-tokens-val"))
