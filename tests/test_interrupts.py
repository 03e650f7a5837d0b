"""Interrupts from a command's first instruction to its last: a Ctrl-C while kasoku is still
importing is one line and exit code 130 (real processes, signalled as early as Python can
take a signal); ``kasoku bench`` stopped by SIGINT or SIGTERM even when started with SIGINT
ignored, its workers ended with it, its interrupted ladder saying what is left and how to
measure it, and an empty folder it made removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _interrupt_when_imported(argv: list[str], module: str, tmp_path: Path):
    """Start ``kasoku ARGV``, SIGINT it the moment it has imported ``module`` (Python's
    ``-X importtime`` lines say so as each import ends); returns ``(exit code, stderr lines
    other than those import lines)``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "kasoku", *argv],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("import time:") and line.split("|")[-1].strip() == module:
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.read().splitlines()
    proc.wait(timeout=60)
    return proc.returncode, [ln for ln in lines if not ln.startswith("import time:")]


@pytest.mark.parametrize("module", ["kasoku.cli.args", "torch.overrides"])
def test_ctrl_c_while_importing_is_one_line_and_130(tmp_path, module):
    """SIGINT as kasoku's command line starts to import, and in the middle of torch's import:
    no traceback, one line, 130."""
    code, err = _interrupt_when_imported(["train", "mnist-mlp", "--synthetic", "--device",
                                          "cpu", "--out", str(tmp_path / "run")], module,
                                         tmp_path)
    assert err == ["kasoku: interrupted"], err
    assert code == 130
    assert not (tmp_path / "run").exists()
