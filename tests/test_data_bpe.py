"""gpt:tokenizer=bpe: a byte-level BPE tokenizer (Hugging Face tokenizers) trained on a real
folder of text once and cached beside the token file, its ids written as uint16, the model's
vocabulary the tokenizer's padded to a multiple of 64; the clear error without the library;
the settings that make no sense refused; the progress of a long tokenization; the GPT recipe's
optimizer (AdamW betas 0.9, 0.95, clipping at 1.0) and the tokens seen in the log."""
import json
import random
import sys

import numpy as np
import pytest
import torch

from kasoku.cli import main
from kasoku.commands.train import build_trainer, close_run
from kasoku.core.errors import ConfigError
from kasoku.data import text as text_mod
from kasoku.data.config import DataConfig
from kasoku.data.text import text_files, tokenize
from kasoku.models.gpt_shapes import padded_vocab
from kasoku.run import resolve
from kasoku.train.config import TrainConfig
from kasoku.workloads import create_workload

pytest.importorskip("tokenizers")
from kasoku.data.bpe import DOC_END, trained  # noqa: E402  (after the skip: needs the library)


def random_prose(seed: int, sentences: int) -> str:
    """Sentences of 300 made-up words: text with pairs to merge, not one phrase repeated."""
    r = random.Random(seed)
    words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 8)))
             for _ in range(300)]
    return "\n".join(" ".join(r.choice(words) for _ in range(r.randint(5, 15))).capitalize()
                     + "." for _ in range(sentences)) + "\n"


@pytest.fixture
def prose_dir(tmp_path):
    """Four files of ~7 KB: ~20,000 tokens at 500 (made-up words merge less than prose)."""
    folder = tmp_path / "prose"
    (folder / "more").mkdir(parents=True)
    for i in range(3):
        (folder / f"{i}.txt").write_text(random_prose(i, 120))
    (folder / "more" / "last.md").write_text(random_prose(9, 120))
    return folder


def test_trained_once_cached_and_reused(prose_dir, tmp_path, capsys):
    cache, files = tmp_path / "cache", text_files(prose_dir)
    tok = trained(prose_dir, files, 500, cache=cache)
    err = capsys.readouterr().err
    assert "training a BPE tokenizer of 500 tokens on 3 of the 4 files" in err  # the last held
    assert tok.path.parent == cache and tok.path.name.startswith("bpe-500-")
    assert tok.vocab_size == 500 and tok.dtype == "uint16"
    assert tok.tokenizer.token_to_id(DOC_END) == tok.doc_end == 0
    stamp = tok.path.stat().st_mtime_ns
    again = trained(prose_dir, files, 500, cache=cache)
    assert "training" not in capsys.readouterr().err  # loaded, not trained again
    assert again.path == tok.path and tok.path.stat().st_mtime_ns == stamp
    assert again.name == tok.name and trained(prose_dir, files, 512, cache=cache).name != tok.name
    # Trained again elsewhere (a cache deleted, another worker): the same tokenizer.
    other = trained(prose_dir, files, 500, cache=tmp_path / "other")
    assert other.path.read_bytes() == tok.path.read_bytes()

    corpus = tokenize(prose_dir, files, cache=cache, tokenizer=tok)
    ids = np.fromfile(corpus.tokens, dtype=np.uint16)
    assert corpus.dtype == "uint16" and corpus.vocab_size == 500
    assert corpus.tokens.stat().st_size == 2 * corpus.n_tokens == 2 * len(ids)
    assert corpus.tokens.parent == tok.path.parent  # beside the tokenizer
    # Fewer tokens than bytes; the documents end with DOC_END; decoding gives the text back.
    size = sum(f.stat().st_size for f in files)
    assert size / 5 < corpus.n_tokens < size * 0.8 and ids.max() < 500
    ends = np.flatnonzero(ids == tok.doc_end)
    assert len(ends) == 4 and ends[-1] == len(ids) - 1
    assert tok.decode(ids[:ends[0]]) == files[0].read_text()
    assert tokenize(prose_dir, files, cache=cache, tokenizer=tok) == corpus  # the cached file


def test_the_model_takes_the_tokenizers_vocabulary_padded(prose_dir, tmp_path):
    assert [padded_vocab(n) for n in (1, 64, 65, 500, 8192, 50257)] == \
        [64, 64, 128, 512, 8192, 50304]
    wl = create_workload("gpt:tokenizer=bpe,vocab=500")
    assert wl.shape.vocab_size == 512 and "BPE token (500)" in wl.description
    train, val = wl.build_datasets(DataConfig(root=prose_dir, cache=tmp_path / "cache"))
    x, y = train.get_batch(torch.arange(4))
    assert x.shape == (4, 64) and x.dtype == torch.int64 and int(x.max()) < 500
    assert torch.equal(x[:, 1:], y[:, :-1]) and len(val) >= 1
    model = wl.build_model()
    assert model.wte.weight.shape[0] == model.head.weight.shape[0] == 512
    assert model(x).shape == (4, 64, 512)
    assert create_workload("gpt:tokenizer=bpe,model_size=small").shape.vocab_size == 8192


def test_without_tokenizers_one_clear_line(prose_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    assert main(["train", "gpt", "--tokenizer", "bpe", "--data", str(prose_dir),
                 "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "kasoku: error: gpt:tokenizer=bpe needs Hugging Face tokenizers: pip install tokenizers"


def test_settings_that_make_no_sense_are_refused():
    for spec, words in (("gpt:vocab=4096", "add tokenizer=bpe, or leave vocab out"),
                        ("gpt:tokenizer=bpe,vocab=100", "must be 258 to"),
                        ("gpt:tokenizer=bpe,vocab=many", "whole number"),
                        ("gpt:tokenizer=wordpiece", "byte, bpe")):
        with pytest.raises(ConfigError, match=words):
            create_workload(spec)
    wl = create_workload("gpt:tokenizer=bpe,vocab=4096")
    assert wl.config.vocab == 4096 and wl.spec == "gpt:model_size=tiny,attention=sdpa," \
        "bias=yes,tokenizer=bpe,vocab=4096"
    assert create_workload("gpt").config.tokenizer == "byte"  # the default stays byte-level


def test_a_long_tokenization_says_how_far_it_is(prose_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_mod, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", 1)  # a batch per file
    files = text_files(prose_dir)
    tok = trained(prose_dir, files, 500, cache=tmp_path / "cache")
    capsys.readouterr()
    tokenize(prose_dir, files, cache=tmp_path / "cache", tokenizer=tok)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(f"({tok.name}): 1/4 files") and lines[-1].endswith("4/4 files")


def test_the_recipe_is_gpt2s_optimizer_and_the_log_counts_tokens(prose_dir, tmp_path, capsys):
    wl = create_workload("gpt")
    assert wl.recipe.betas == (0.9, 0.95) and wl.recipe.grad_clip == 1.0
    assert resolve(wl).train.grad_clip == 1.0
    assert resolve(wl, train=TrainConfig(grad_clip=0.5)).train.grad_clip == 0.5  # yours wins
    trainer = build_trainer(wl, DataConfig(synthetic=True, synthetic_train_size=16,
                                                synthetic_val_size=8),
                            TrainConfig(device="cpu", progress=False, batch_size=8),
                            out=tmp_path / "synth")
    assert {g["betas"] for g in trainer.optimizer.param_groups} == {(0.9, 0.95)}
    close_run(trainer)
    out = tmp_path / "run"
    assert main(["train", "gpt:tokenizer=bpe,vocab=500", "--data", str(prose_dir),
                 "--data-cache", str(tmp_path / "cache"), "--out", str(out), "--epochs", "1",
                 "--batch-size", "8", "--threads", "1", "--no-progress", "--log-interval",
                 "4"]) == 0
    assert "adamw lr 0.001 betas 0.9,0.95 clip 1" in capsys.readouterr().err
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [e["tokens"] for e in log[:2]] == [4 * 8 * 64, 8 * 8 * 64]
    assert "main/grad_norm" in log[0] and "validation/main/loss" in log[-1]
    assert log[0]["main/loss"] < np.log(500) + 0.5  # nats per token, from ln(vocab)
