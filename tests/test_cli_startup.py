"""Start-up: ``kasoku --version``, ``--help``, a command's ``--help``, ``kasoku list`` and every
mistake in the arguments answer without importing torch (the heavy imports come with the
command that needs them), each with the output and exit code it always had. Each case runs
the real front door, ``python -X importtime -m kasoku ARGS``, in a fresh process; the
interpreter's import log says whether torch was loaded. (How fast they answer is measured, not
tested: docs/architecture.md gives the figures.)"""
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from kasoku.accel.config import AccelConfig
from kasoku.core.version import __version__

BENCH_CONFIG_KEYS = ", ".join(f.name for f in fields(AccelConfig))
ERRORS = {
    "an unknown flag": (["train", "mnist-mlp", "--epochz", "3"],
                        "kasoku train: error: unrecognized arguments: --epochz 3; did you mean "
                        "--epochs? (see kasoku train --help)"),
    "an unknown command": (["nosuch"],
                           "kasoku: error: argument {list,train,profile,run,bench,compare,data,"
                           "allreduce-bench,scale}: invalid choice: 'nosuch' (choose from 'list', "
                           "'train', 'profile', 'run', 'bench', 'compare', 'data', "
                           "'allreduce-bench', 'scale') (see kasoku --help)"),
    "a missing argument": (["train"], "kasoku train: error: the following arguments are "
                                      "required: workload (see kasoku train --help)"),
    "a missing option": (["data", "make-jpeg"],
                         "kasoku data make-jpeg: error: the following arguments are required: "
                         "--out (see kasoku data make-jpeg --help)"),
    "a bad choice": (["train", "mnist-mlp", "--precision", "fp64"],
                     "kasoku train: error: argument --precision: must be one of fp32, tf32, "
                     "fp16, bf16, fp16-pure, got 'fp64' (see kasoku train --help)"),
    "a workload setting's bad choice": (
        ["bench", "gpt", "--model-size", "huge"],
        "kasoku bench: error: argument --model-size: must be one of tiny, small, medium, large, "
        "xl, got 'huge' (see kasoku bench --help)"),
    "a bad loader": (["scale", "mnist-mlp", "--loader", "threads:x"],
                     "kasoku scale: error: argument --loader: loader 'threads:x': N (threads) "
                     "must be a whole number >= 1, got 'x' (see kasoku scale --help)"),
    "a bad size": (["allreduce-bench", "--max-size", "0"],
                   "kasoku allreduce-bench: error: argument --max-size: size '0': give bytes as "
                   "N, NK, NM or NG (powers of 1024), e.g. 4K,1M,64M (see kasoku allreduce-bench "
                   "--help)"),
    # A --config rung's keys and values are read without torch (its levers' combinations with it)
    "a bad --config rung": (["bench", "mnist-mlp", "--config", "nonsense"],
                            "kasoku bench: error: argument --config: unknown bench config key "
                            "'nonsense' in 'nonsense'; known keys: " + BENCH_CONFIG_KEYS + " (plus "
                            "the shorthands fused, foreach, loop, cudnn, graph and a bare "
                            "precision) (see kasoku bench --help)"),
    "a bad --config value": (["scale", "mnist-mlp", "--config", "precision=fp64"],
                             "kasoku scale: error: argument --config: unknown precision 'fp64'; "
                             "choose one of fp32, tf32, fp16, bf16, fp16-pure (see kasoku scale "
                             "--help)"),
    "a --config rung naming no lever": (["compare", "mnist-mlp", "--cpu-config", ","],
                                        "kasoku compare: error: argument --cpu-config: rung ',' "
                                        "names no lever; give a ladder label (amp, +compile) or "
                                        "settings such as precision=bf16,channels_last (see "
                                        "kasoku compare --help)"),
    # argparse parses data bench's default --loader list (a string) before it refuses --bogus
    "an unknown flag of data bench": (["data", "bench", "--bogus"],
                                      "kasoku data bench: error: unrecognized arguments: --bogus "
                                      "(see kasoku data bench --help)"),
}


def kasoku(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -X importtime -m kasoku ARGS``: the finished process (its stderr without the
    import log) and the modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kasoku", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    log = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    done.stderr = "".join(line + "\n" for line in done.stderr.splitlines()
                          if not line.startswith("import time:"))
    return done, [line.rsplit("|", 1)[-1].strip() for line in log]


def test_the_import_log_shows_torch_where_a_command_runs(tmp_path):
    """The probe can fail: a command that runs (bench redrawing results) loads torch."""
    done, imported = kasoku("bench", "mnist-mlp", "--report", "--out", str(tmp_path))
    assert done.returncode == 2 and "--report: no results.jsonl in" in done.stderr
    assert "torch" in imported


def test_version_without_torch():
    done, imported = kasoku("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"kasoku {__version__}\n", "")
    assert "torch" not in imported and "kasoku.cli" in imported


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["profile", "--help"],
                                  ["bench", "--help"], ["compare", "--help"],
                                  ["data", "bench", "--help"], ["allreduce-bench", "--help"],
                                  ["scale", "--help"]], ids=" ".join)
def test_help_without_torch(args):
    done, imported = kasoku(*args)
    prog = " ".join(["kasoku", *args[:-1]])
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith(f"usage: {prog} ")
    assert "torch" not in imported


def test_train_help_names_every_loader_and_the_workloads_settings():
    """The help that needs the registries (loaders, gpt's settings) builds them without torch."""
    from kasoku.data.registry import list_loaders
    done, imported = kasoku("train", "--help")
    flat = " ".join(done.stdout.split())
    assert all(f"{name}" in flat for name in list_loaders())
    assert "--model-size {tiny,small,medium,large,xl}" in flat
    assert "torch" not in imported


def test_list_without_torch(capsys):
    """``kasoku list`` in a fresh process, torch never loaded, prints what it prints here, in a
    process that has loaded torch and a model."""
    from kasoku.cli import main
    from kasoku.workloads import create_workload
    create_workload("gpt").build_model()
    assert main(["list"]) == 0
    here = capsys.readouterr().out
    done, imported = kasoku("list")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == here
    assert "torch" not in imported
    mnist = next(line for line in here.splitlines() if line.startswith("mnist-mlp"))
    assert mnist.split()[-4:] == ["adam", "0.001", "100", "20"]


@pytest.mark.parametrize("case", ERRORS, ids=str)
def test_a_mistake_in_the_arguments_without_torch(case):
    args, line = ERRORS[case]
    done, imported = kasoku(*args)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")
    assert "torch" not in imported
