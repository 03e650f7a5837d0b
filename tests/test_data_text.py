"""Text tokenized once into a cached file: written atomically, reused for the same files,
made again when one changes; files that are not UTF-8 left out and counted, or an error with
--strict-data; windows of it as next-token samples, cut at another place each epoch."""
import os
import pickle
import warnings

import pytest
import torch

from kasoku.core.errors import DataError, reset_warnings
from kasoku.data.bad_files import BadFile
from kasoku.data.text import DOC_END, cache_dir, stdlib_files, text_files, tokenize
from kasoku.data.tokens import TokenWindows, synthetic_token_datasets, token_datasets


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "text"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("héllo\n" * 50)
    (root / "sub" / "b.txt").write_text("world\n" * 50)
    (root / "image.jpg").write_bytes(b"\xff\xd8\xff")   # not a text suffix: not read
    (root / ".hidden.txt").write_text("secret")
    return root


def test_tokenized_once_then_reused_until_a_file_changes(folder, tmp_path):
    cache = tmp_path / "cache"
    files = text_files(folder)
    assert [f.relative_to(folder).as_posix() for f in files] == ["a.txt", "sub/b.txt"]
    first = tokenize(folder, files, cache=cache)
    data = first.tokens.read_bytes()
    a, b = (folder / "a.txt").read_bytes(), (folder / "sub" / "b.txt").read_bytes()
    assert data == a + bytes([DOC_END]) + b + bytes([DOC_END])   # byte-level, joined
    assert first.n_tokens == len(data) and first.n_files == 2
    assert not list(cache.glob("*.tmp"))
    stamp = first.tokens.stat().st_mtime_ns
    again = tokenize(folder, files, cache=cache)
    assert again == first and again.tokens.stat().st_mtime_ns == stamp   # not written again
    os.utime(folder / "a.txt", ns=(stamp + 10**9, stamp + 10**9))
    changed = tokenize(folder, files, cache=cache)
    assert changed.tokens != first.tokens and len(list(cache.glob("tokens-*.json"))) == 2


def test_a_file_not_utf8_is_left_out_and_counted_or_refused(folder, tmp_path):
    (folder / "latin1.txt").write_bytes("café".encode("latin-1"))
    reset_warnings()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        corpus = tokenize(folder, text_files(folder), cache=tmp_path / "cache")
    assert corpus.n_files == 2 and corpus.skipped[0][0].endswith("latin1.txt")
    (line,) = [str(w.message) for w in said]
    assert line.startswith("1 of 3 text files under") and "not UTF-8: byte 0xe9" in line
    assert "--strict-data" in line
    with pytest.raises(BadFile, match="latin1.txt: not UTF-8"):
        tokenize(folder, text_files(folder), cache=tmp_path / "strict", strict=True)
    with pytest.raises(BadFile, match="latin1.txt"):   # the cache kept what it left out
        tokenize(folder, text_files(folder), cache=tmp_path / "cache", strict=True)


def test_no_text_says_so(tmp_path):
    with pytest.raises(DataError, match="holds no text files"):
        tokenize(tmp_path, text_files(tmp_path), cache=tmp_path / "cache")
    with pytest.raises(DataError, match="no such folder"):
        text_files(tmp_path / "missing")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match="none of its 1 text files is UTF-8"):
        tokenize(tmp_path, text_files(tmp_path), cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*"))   # nothing half-written


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KASOKU_CACHE", str(tmp_path / "k"))
    assert cache_dir() == tmp_path / "k" and cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("KASOKU_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kasoku"


def test_the_standard_library_corpus():
    root, files = stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert (root / "os.py") in files
    assert not any("site-packages" in f.parts for f in files)


def test_windows_are_next_token_pairs_cut_per_epoch(folder, tmp_path):
    corpus = tokenize(folder, text_files(folder), cache=tmp_path / "cache")
    train, val = token_datasets(corpus, block_size=16, seed=5)
    tokens = torch.tensor(list(corpus.tokens.read_bytes()))
    x, y = train.get_batch(torch.arange(len(train)))
    assert x.dtype == y.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    first = train.start + train.offset
    assert torch.equal(x[0], tokens[first:first + 16])
    assert int(val.start) >= len(train) * 16 + train.offset + 1   # no token shared
    offsets = set()
    for epoch in range(6):
        train.set_epoch(epoch)
        offsets.add(train.offset)
        train.get_batch(torch.tensor([len(train) - 1]))   # the last window still fits
    assert len(offsets) > 1
    train.set_epoch(2)
    copy = pickle.loads(pickle.dumps(train))   # a loader worker's: the path, not the tokens
    assert copy._tokens is None and torch.equal(copy.get_batch(torch.arange(3))[0],
                                                train.get_batch(torch.arange(3))[0])
    with pytest.raises(IndexError):
        train.get_batch(torch.tensor([len(train)]))
    assert isinstance(val, TokenWindows) and val.offset == 0


def test_generated_tokens_follow_a_learnable_rule():
    train, val = synthetic_token_datasets(64, 8, block_size=32, vocab_size=256, seed=1)
    x, y = train.get_batch(torch.arange(64))
    assert x.shape == (64, 32) and torch.equal(x[:, 1:], y[:, :-1])
    # Most tokens follow one successor of the token before: the pairs repeat.
    pairs = x[:, :-1] * 256 + x[:, 1:]
    assert pairs.unique().numel() < 0.5 * pairs.numel()
    again, _ = synthetic_token_datasets(64, 8, block_size=32, vocab_size=256, seed=1)
    assert torch.equal(again.get_batch(torch.arange(64))[0], x)


def test_a_run_lists_the_files_its_corpus_left_out(tmp_path, capsys):
    """A training run's bad_files.jsonl lists the text files left out (not UTF-8), as it
    lists a loader's bad images; the end of the run counts them."""
    import json

    from kasoku.cli import main
    root = tmp_path / "text"
    root.mkdir()
    (root / "a.txt").write_text("héllo wörld\n" * 600)
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(root), "--data-cache", str(tmp_path / "c"),
                 "--epochs", "1", "--batch-size", "8", "--no-progress", "--out", str(out)]) == 0
    (record,) = [json.loads(x) for x in (out / "bad_files.jsonl").read_text().splitlines()]
    assert record["path"].endswith("latin1.txt") and record["reason"].startswith("not UTF-8")
    assert record["split"] == "train"
    assert "1 bad file skipped, each listed with its reason in" in capsys.readouterr().err


def test_the_data_bench_counts_gpt_in_sequences():
    """A loader hands out whole sequences: the data bench's rate says so, not tokens/s."""
    from kasoku.commands.bench.data_sources import sample_word
    from kasoku.workloads import create_workload
    assert sample_word(create_workload("gpt")) == "64-token sequences"
    assert sample_word(create_workload("gpt:model_size=small")) == "1024-token sequences"
    assert sample_word(create_workload("mnist-mlp")) == "samples"
