"""Bad input to every sub-command: each ends with exit code 2 and one line that says what is
wrong (no traceback, no usage block), prints nothing on stdout and leaves no run folder."""
import pytest
import torch

from kasoku.cli import main

TRAIN = ["train", "sine-lstm", "--no-progress", "--synthetic-size", "100", "--threads", "1"]
BENCH = ["bench", "mnist-mlp", "--device", "cpu"]
BAD = [
    # train: numbers where they are parsed
    (TRAIN + ["--epochs", "nan"], "--epochs"),
    (TRAIN + ["--epochs", "inf"], "--epochs"),
    (TRAIN + ["--epochs", "-1"], "--epochs"),
    (TRAIN + ["--epochs", "0"], "--epochs"),
    (TRAIN + ["--epochs", "ten"], "--epochs"),
    (TRAIN + ["--lr", "inf"], "--lr"),
    (TRAIN + ["--lr", "nan"], "--lr"),
    (TRAIN + ["--lr", "0"], "--lr"),
    (TRAIN + ["--lr", "-0.1"], "--lr"),
    (TRAIN + ["--lr", "1e999"], "--lr"),
    (TRAIN + ["--batch-size", "0"], "--batch-size"),
    (TRAIN + ["--batch-size", "2.5"], "--batch-size"),
    (TRAIN + ["--seed", "-1"], "--seed"),
    (TRAIN + ["--seed", "x"], "--seed"),
    (TRAIN + ["--threads", "0"], "--threads"),
    (TRAIN + ["--threads", "100000"], "must be at most"),
    (TRAIN + ["--log-interval", "0"], "--log-interval"),
    (TRAIN + ["--snapshot-interval", "-3"], "--snapshot-interval"),
    (TRAIN + ["--prefetch", "0"], "--prefetch"),
    (TRAIN + ["--synthetic-size", "0"], "--synthetic-size"),
    # train: names
    (TRAIN + ["--loader", "bogus"], "unknown loader"),
    (TRAIN + ["--loader", "threads:0"], "whole number >= 1"),
    (TRAIN + ["--loader", "serial:3"], "takes no :N"),
    (TRAIN + ["--device", "tpu"], "--device"),
    (TRAIN + ["--device", "cuda:x"], "--device"),
    (TRAIN + ["--precision", "fp8"], "--precision"),
    (TRAIN + ["--optimizer-impl", "vectorized"], "--optimizer-impl"),
    (TRAIN + ["--compile", "fastest"], "--compile"),
    (TRAIN + ["--loss-scale-init", "inf"], "--loss-scale-init"),
    (TRAIN + ["--loss-scale-init", "-1"], "--loss-scale-init"),
    (TRAIN + ["--steps-per-call", "0"], "--steps-per-call"),
    (TRAIN + ["--epoch", "3"], "unrecognized arguments"),
    (["train"], "the following arguments are required: workload"),
    (["train", "no-such-workload"], "kasoku list"),
    (["train", "nofile.py:Thing"], "no such file"),
    # train: settings that only fail together, or against the file system
    (TRAIN + ["--matmul-1x1"], "add --channels-last"),
    (TRAIN + ["--fused-bn"], "add --channels-last"),
    (TRAIN + ["--resume", "nowhere/snapshot.pt"], "no such file or folder"),
    (TRAIN + ["--resume", "auto"], "give --out DIR"),
    (TRAIN + ["--out", "a-file"], "is a file"),
    (TRAIN + ["--steps-per-call", "4", "--loader", "threads"], "several batches per call"),
    (TRAIN + ["--prefetch", "2"], "keeps none in flight"),
    # bench
    (BENCH + ["--batch-size", "0,16"], "--batch-size"),
    (BENCH + ["--batch-size", "a"], "--batch-size"),
    (BENCH + ["--windows", "0"], "--windows"),
    (BENCH + ["--steps", "-1"], "--steps"),
    (BENCH + ["--timeout", "nan"], "--timeout"),
    (BENCH + ["--timeout", "0"], "--timeout"),
    (BENCH + ["--kernels", "-1"], "--kernels"),
    (BENCH + ["--peak-size", "0"], "--peak-size"),
    (BENCH + ["--seed", "2.5"], "--seed"),
    (BENCH + ["--config", "nonsense=1"], "unknown bench config key"),
    (BENCH + ["--config", "precision=fp8"], "unknown precision"),
    (BENCH + ["--config", "fp32", "--ladder"], "not allowed with argument"),
    (BENCH + ["--config", ""], "names no lever"),
    (BENCH + ["--config", ","], "names no lever"),
    (BENCH + ["--config", "loss_scale_init=inf"], "positive, finite"),
    (BENCH + ["--threads", "100000"], "must be at most"),
    (BENCH + ["--config", "fp32", "--out", "a-file"], "is a file"),
    (BENCH + ["--loader", "bogus"], "unknown loader"),
    (BENCH + ["--loader", "device"], "--loader needs --data"),
    (BENCH + ["--data", "nowhere"], "no such folder"),
    (["bench", "mnist-mlp", "--device", "tpu"], "--device"),
    (["bench", "no-such-workload", "--device", "cpu"], "kasoku list"),
    # data make-jpeg, download
    (["data", "make-jpeg", "--out", "j", "--count", "0"], "--count"),
    (["data", "make-jpeg", "--out", "j", "--quality", "200"], "--quality"),
    (["data", "make-jpeg", "--out", "j", "--quality", "0"], "--quality"),
    (["data", "make-jpeg", "--out", "j", "--resolution", "0x10"], "--resolution"),
    (["data", "make-jpeg", "--out", "j", "--resolution", "big"], "--resolution"),
    (["data", "make-jpeg", "--out", "j", "--classes", "0"], "--classes"),
    (["data", "make-jpeg", "--out", "j", "--workers", "0"], "--workers"),
    (["data", "make-jpeg", "--count", "4"], "required: --out"),
    (["data", "make-jpeg", "--out", "a-file", "--count", "20"], "is a file"),
    (["data", "make-jpeg", "--out", "/proc/kasoku-jpeg", "--count", "20"], "cannot create"),
    (["data", "make-jpeg", "--out", "j", "--count", "4"], "cannot fill 10 class folders"),
    (["data", "download", "imagenet", "--out", "d"], "invalid choice"),
    (["data", "download", "mnist"], "required: --out"),
    (["data", "download", "mnist", "--out", "a-file"], "is a file"),
    # data bench
    (["data", "bench", "mnist-mlp", "--batch-size", "0"], "--batch-size"),
    (["data", "bench", "mnist-mlp", "--windows", "0"], "--windows"),
    (["data", "bench", "mnist-mlp", "--warmup", "-1"], "--warmup"),
    (["data", "bench", "mnist-mlp", "--images", "0"], "--images"),
    (["data", "bench", "mnist-mlp", "--image-size", "4"], "--image-size"),
    (["data", "bench", "--resolution", "10"], "--resolution"),
    (["data", "bench", "mnist-mlp", "--loader", "serial,fast:2"], "unknown loader"),
    (["data", "bench", "mnist-mlp", "--loader", "4,serial"], "continues no loader"),
    (["data", "bench", "nowhere"], "neither a folder nor a workload"),
    (["data", "bench", "mnist-mlp", "--precision", "bf16"], "give --model"),
    (["data", "bench"], "give a SOURCE"),
    (["data", "bench", "mnist-mlp", "--synthetic", "--out", "a-file"], "is a file"),
    # list and the top level
    (["list", "extra"], "unrecognized arguments"),
    # (a bare `kasoku` prints its help: tests/test_front_door.py)
    (["frobnicate"], "invalid choice"),
]
if not torch.cuda.is_available():
    BAD += [(TRAIN + ["--device", "cuda"], "sees no CUDA device"),
            (BENCH[:2] + ["--device", "cuda:0"], "sees no CUDA device")]


def test_the_table_is_long():
    assert len(BAD) >= 40


@pytest.mark.parametrize("argv, what", BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD])
def test_a_bad_value_ends_in_one_line_and_exit_code_2(argv, what, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kasoku") and " error: " in lines[0], lines[0]
    assert what in lines[0], lines[0]
    assert captured.out == ""
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())  # no run folder left behind
