"""The front door: how ``kasoku`` gets on the PATH, a bare ``kasoku``, progress lines in a log,
and an ``--epochs`` that rounds up to whole iterations said once."""
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kasoku.cli import build_parser, main
from kasoku.core.errors import reset_warnings
from kasoku.core.status_line import StatusLine
from kasoku.core.version import __version__
from kasoku.train.standard import ROUNDING_NOTED, rounded_epochs
from kasoku.train.triggers import IntervalTrigger

ROOT = Path(__file__).resolve().parents[1]
SETUP_AND_MAIN_JOB = "bash scripts/setup.sh && .venv/bin/kasoku bench mnist-mlp --out runs/bench"
SETUP_AND_TESTS = "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q"


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False,
                          **kwargs)


def test_readme_says_how_kasoku_gets_on_the_path():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    # The two commands stay as they are, and CI runs the second one verbatim.
    assert f"```\n{SETUP_AND_MAIN_JOB}\n```" in setup
    assert f"```\n{SETUP_AND_TESTS}\n```" in setup
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == SETUP_AND_TESTS
    assert "source .venv/bin/activate" in setup and "pip install -e ." in setup


def test_activating_the_venv_puts_kasoku_on_the_path():
    """What the README says works: in a shell whose PATH has no kasoku, activating the venv
    gives the command."""
    activate = ROOT / ".venv" / "bin" / "activate"
    if not activate.is_file():
        pytest.skip("no .venv here (scripts/setup.sh makes it)")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    assert _run(["bash", "-c", "command -v kasoku"], env=env).returncode != 0
    proc = _run(["bash", "-c", f"source {activate} && kasoku --version"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kasoku {__version__}"


def test_bare_kasoku_prints_the_help():
    proc = _run([sys.executable, "-m", "kasoku"])
    assert proc.returncode == 2  # nothing was done, as argparse says of a missing command
    assert proc.stderr == ""
    assert proc.stdout == build_parser().format_help()
    for command in ("list", "train", "profile", "bench", "compare", "data", "scale"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.MULTILINE), command


def test_make_jpeg_progress_in_a_log_is_whole_lines(tmp_path):
    count = 300  # progress every 100 images
    proc = _run([sys.executable, "-m", "kasoku", "data", "make-jpeg", "--out",
                 str(tmp_path / "j"), "--count", str(count), "--classes", "2",
                 "--resolution", "16x16", "--workers", "1"])
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("make-jpeg:")]
    assert progress and progress[-1] == f"make-jpeg: {count}/{count} images"
    assert proc.stderr.endswith("\n")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_redraws_on_a_terminal_and_writes_lines_elsewhere():
    tty = _Terminal()
    with StatusLine(tty) as line:
        line.update("copy: 10/100")
        line.update("copy: 9")  # shorter: the rest of the longer line is blanked
    assert tty.getvalue() == "\rcopy: 10/100\rcopy: 9     \n"
    every = io.StringIO()
    with StatusLine(every, every_s=0) as line:
        for k in range(3):
            line.update(f"step {k}")
    assert every.getvalue() == "step 0\nstep 1\nstep 2\n"
    rare = io.StringIO()  # the first at once, then the latest held back until close
    with StatusLine(rare, every_s=3600) as line:
        for k in range(3):
            line.update(f"step {k}")
        assert rare.getvalue() == "step 0\n"
    assert rare.getvalue() == "step 0\nstep 2\n"
    quiet = _Terminal()
    StatusLine(quiet).close()  # nothing drawn: no empty line
    assert quiet.getvalue() == ""


def test_rounded_epochs_speaks_only_of_a_noticeable_rounding():
    per_epoch = 469  # MNIST's 60,000 at batch 128
    assert rounded_epochs(IntervalTrigger(0.5, "epoch"), per_epoch) is None  # 234.5 -> 235
    assert rounded_epochs(IntervalTrigger(3, "epoch"), per_epoch) is None
    assert rounded_epochs(IntervalTrigger(10, "iteration"), per_epoch) is None
    asked = 1.5  # iterations: rounded up by a third
    note = rounded_epochs(IntervalTrigger(asked / 8, "epoch"), 8)
    assert note is not None and "trains 2 iterations (0.25 epochs)" in note
    edge = 1 / (1 + ROUNDING_NOTED)  # of one iteration: rounded up to 1 by exactly the limit
    assert rounded_epochs(IntervalTrigger(edge - 0.01, "epoch"), 1) is not None
    assert rounded_epochs(IntervalTrigger(edge + 0.01, "epoch"), 1) is None
    assert rounded_epochs(IntervalTrigger(20.5 / 8, "epoch"), 8) is None  # 20.5 -> 21


def test_a_fraction_of_an_epoch_below_one_batch_is_said_once(tmp_path, capsys):
    samples, batch, epochs = 200, 50, 0.01
    per_epoch = samples // batch
    argv = ["train", "sine-lstm", "--synthetic-size", str(samples), "--batch-size", str(batch),
            "--no-progress", "--threads", "1"]
    reset_warnings()
    assert main([*argv, "--epochs", str(epochs), "--out", str(tmp_path / "a")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "--epochs" in line]
    assert len(warned) == 1
    assert warned[0].startswith("kasoku: warning: --epochs 0.01 asks for ")
    assert f"{epochs * per_epoch:.3g} iterations" in warned[0]
    assert f"trains 1 iteration ({1 / per_epoch:.4g} epochs)" in warned[0]
    log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["iteration"] == 1
    reset_warnings()
    assert main([*argv, "--epochs", "1", "--out", str(tmp_path / "b")]) == 0
    assert "--epochs" not in capsys.readouterr().err
