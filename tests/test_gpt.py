"""The gpt workload: the model (GPT-2's shapes and parameter counts, tied weights, the two
attentions alike, causal), its FLOP formula against the formula written out and against
PyTorch's operator count, its settings in the name and as flags, and `kasoku train gpt` on a
folder of text and on generated tokens, resumed bit-identical."""
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kasoku.cli import main
from kasoku.commands.bench import worker
from kasoku.commands.bench.pool import batch_spec
from kasoku.commands.bench.rungs import PLAIN, cpu_ladder
from kasoku.commands.bench.sweep import SweepConfig, _prepare
from kasoku.commands.train import build_trainer
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.models.gpt import GPT, GPT_SHAPES
from kasoku.perf.flops import transformer_flops_per_token
from kasoku.train import load_snapshot
from kasoku.train.config import TrainConfig
from kasoku.train.triggers import get_trigger
from kasoku.workloads import create_workload
from kasoku.workloads.registry import split_settings, with_settings

TINY = GPT_SHAPES["tiny"]
PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
         "was the age of foolishness, it was the epoch of belief, it was the epoch of "
         "incredulity, it was the season of Light, it was the season of Darkness.\n")


@pytest.fixture
def text_dir(tmp_path):
    """Two text files, 2,762 tokens: 37 training windows of 64 tokens, 4 for validation."""
    folder = tmp_path / "text"
    (folder / "more").mkdir(parents=True)
    (folder / "a.txt").write_text(PROSE * 6)
    (folder / "more" / "b.md").write_text(PROSE.upper() * 6)
    return folder


def test_model_sizes_are_gpt2s():
    with torch.device("meta"):
        models = {size: GPT(GPT_SHAPES[size]) for size in ("small", "medium", "large", "xl")}
    # GPT-2's published sizes: 124M, 355M, 774M, 1558M (the vocabulary padded to 50,304)
    assert {size: round(m.num_params(non_embedding=False) / 1e6) for size, m in models.items()} \
        == {"small": 124, "medium": 355, "large": 774, "xl": 1558}
    small = models["small"]
    assert len(small.blocks) == 12 and isinstance(small.blocks, torch.nn.ModuleList)


def test_the_head_is_the_token_embedding_and_attentions_agree():
    torch.manual_seed(0)
    sdpa = GPT(TINY, "sdpa").eval()
    plain = GPT(TINY, "plain").eval()
    plain.load_state_dict(sdpa.state_dict())  # one state dict for both
    assert sdpa.head.weight is sdpa.wte.weight
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    with torch.no_grad():
        out = sdpa(idx)
        torch.testing.assert_close(plain(idx), out, rtol=1e-4, atol=1e-5)
        # Causal: a later token changes no earlier position's logits.
        changed = idx.clone()
        changed[:, 40] = (changed[:, 40] + 1) % TINY.vocab_size
        after = sdpa(changed)
    assert out.shape == (2, TINY.block_size, TINY.vocab_size)
    torch.testing.assert_close(after[:, :40], out[:, :40])
    assert not torch.allclose(after[:, 40:], out[:, 40:])


def test_flops_per_token_is_the_formula():
    s = GPT_SHAPES["small"]
    with torch.device("meta"):
        model = GPT(s)
    n = model.num_params()  # position embeddings left out, the tied head counted once
    assert n == model.num_params(non_embedding=False) - s.block_size * s.n_embd
    per_token = transformer_flops_per_token(n, s.n_layer, s.n_embd, s.block_size)
    assert per_token == 6 * n + 12 * 12 * 768 * 1024
    wl = create_workload("gpt:model_size=small")
    flops = wl.step_flops(model, None, batch_size=3)
    assert flops.total == per_token * 3 * 1024 and flops.forward * 3 == flops.total
    assert sum(flops.by_op.values()) == flops.total


def test_the_formula_matches_pytorchs_count_of_the_plain_model():
    """The operator count of the plain attention's matrix products (what the formula
    counts: the causal half included) is the formula within the terms it leaves out (biases,
    norms)."""
    wl = create_workload("gpt:attention=plain")
    model = wl.build_model()
    x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    with FlopCounterMode(display=False) as counter:
        wl.loss_fn(model(x), x).backward()
    counted = counter.get_total_flops()
    formula = wl.step_flops(model, None, 2).total
    assert abs(counted - formula) / formula < 0.03, (counted, formula)


def test_settings_travel_in_the_name():
    assert split_settings("gpt:model-size=small,attention=plain") == \
        ("gpt", {"model_size": "small", "attention": "plain"})
    assert split_settings("examples/stripes_cnn.py:StripesCNN") == \
        ("examples/stripes_cnn.py:StripesCNN", {})
    assert with_settings("gpt:attention=plain", {"model_size": "small", "attention": None}) \
        == "gpt:attention=plain,model_size=small"
    wl = create_workload("gpt:attention=plain")
    assert wl.config.attention == "plain" and wl.units_per_sample == 64
    assert wl.sample_unit == "tokens" and wl.recipe.optimizer == "adamw"
    for bad, words in (("gpt:model_size=huge", "tiny, small, medium"),
                       ("gpt:heads=3", "has no setting heads"),
                       ("mnist-mlp:model_size=small", "takes no settings")):
        with pytest.raises(ConfigError, match=words):
            create_workload(bad)


def test_the_bench_batches_are_token_ids():
    wl = create_workload("gpt")
    spec = batch_spec(wl, wl.build_model())
    x, y = spec.make_batch(3, torch.device("cpu"))
    assert spec.input_range == "tokens" and spec.num_classes == TINY.vocab_size
    assert x.shape == y.shape == (3, TINY.block_size) and x.dtype == torch.int64


def test_bench_counts_tokens_and_the_formula(tmp_path):
    """A rung's rate in tokens/s, plain and kasoku's fp32 step alike (AdamW's groups the
    same), and the sweep's FLOPs (MFU's numerator) the formula's."""
    records = [worker.run(worker.WorkerRequest("gpt:attention=plain", rung, batch_size=4,
                                               steps=2, windows=3, warmup=1,
                                               numerics_steps=3, profile_steps=0, threads=1))
               for rung in (PLAIN, cpu_ladder()[1])]
    for rec in records:
        assert rec["status"] == "ok", rec["error"]
        f = rec["figures"]
        assert rec["unit"] == "tokens" and rec["workload"] == "gpt:attention=plain"
        tokens_per_s = 4 * TINY.block_size / (f["step_time_ms"]["median"] / 1e3)
        assert f["samples_per_s"]["median"] == pytest.approx(tokens_per_s, rel=0.1)
    assert records[1]["numerics"]["losses"] == \
        pytest.approx(records[0]["numerics"]["losses"], rel=1e-5)
    cfg = SweepConfig("gpt", (PLAIN,), (4, 8), tmp_path)
    _, _, flops = _prepare(cfg, say=lambda line: None)
    assert flops[8].total == 2 * flops[4].total and flops[4].method.startswith("formula")


ARGS = ["--batch-size", "8", "--threads", "1", "--no-progress", "--log-interval", "4"]


def _log(out):
    return [json.loads(line) for line in open(out / "log.jsonl")]


def test_train_on_a_text_folder_and_on_generated_tokens(tmp_path, text_dir, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_dir), "--epochs", "3", "--out", str(out),
                 "--data-cache", str(tmp_path / "cache"), "--lr", "3e-3", *ARGS]) == 0
    log = _log(out)
    assert log[-1]["main/loss"] < log[0]["main/loss"] < math.log(256) + 0.5
    assert "validation/main/loss" in log[-1] and 0 <= log[-1]["main/accuracy"] <= 1
    err = capsys.readouterr().err
    assert f"data: {text_dir}" in err
    assert len(list((tmp_path / "cache").glob("tokens-*.bytes"))) == 1
    synthetic = tmp_path / "synthetic"
    assert main(["train", "gpt", "--synthetic", "--synthetic-size", "64", "--epochs", "2",
                 "--out", str(synthetic), *ARGS]) == 0
    log = _log(synthetic)
    assert log[-1]["main/loss"] < log[0]["main/loss"]


def test_no_text_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "gpt", "--data", str(tmp_path / "empty"), *ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no text files" in err and ".txt" in err
    assert main(["train", "gpt", "--model-size", "huge", *ARGS]) == 2
    assert "tiny, small, medium" in capsys.readouterr().err


def _trainer(out, text_dir, cache, stop=None, spec="gpt"):
    train = TrainConfig(epochs=3, batch_size=8, threads=1, progress=False, log_interval=2,
                        snapshot_interval=3, device="cpu")
    trainer = build_trainer(create_workload(spec), DataConfig(root=text_dir, cache=cache),
                            train, out=out)
    if stop is not None:  # the same run (its schedule spans 3 epochs), stopped early
        trainer.stop_trigger = get_trigger((stop, "iteration"))
    return trainer


@pytest.mark.parametrize("spec", ["gpt", "gpt:tokenizer=bpe,vocab=512"])
def test_resume_is_bit_identical(tmp_path, text_dir, spec):
    """Stopped mid-epoch 2 (5 iterations an epoch, the cut moved each epoch) and resumed:
    the weights and every logged loss as the run that never stopped; with bpe, the resumed
    run reads the tokenizer and the token file the first one made."""
    if spec != "gpt":
        pytest.importorskip("tokenizers")
        from test_data_bpe import random_prose
        text_dir = tmp_path / "prose"
        text_dir.mkdir()
        for i in range(2):  # ~6,000 tokens: 9 iterations of 8 windows an epoch
            (text_dir / f"{i}.txt").write_text(random_prose(i, 60))
    cache = tmp_path / "cache"
    whole = _trainer(tmp_path / "whole", text_dir, cache, spec=spec)
    whole.run()
    made = sorted(p.stat().st_mtime_ns for p in cache.iterdir())
    cut = _trainer(tmp_path / "cut", text_dir, cache, stop=6, spec=spec)
    cut.run()
    resumed = _trainer(tmp_path / "cut", text_dir, cache, spec=spec)
    resumed.run(resume=tmp_path / "cut" / "snapshot_latest.pt")
    assert sorted(p.stat().st_mtime_ns for p in cache.iterdir()) == made  # none made again
    a = load_snapshot(tmp_path / "whole" / "snapshot_latest.pt")["model"]
    b = load_snapshot(tmp_path / "cut" / "snapshot_latest.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[(e["iteration"], e["main/loss"]) for e in _log(tmp_path / run)]
              for run in ("whole", "cut")]
    assert losses[0] == losses[1] and losses[0][-1][0] == whole.updater.iteration
    assert whole.updater.iteration == 15 if spec == "gpt" else whole.updater.iteration > 6
