"""The code's lint (``pyproject.toml``'s ``[tool.ruff]``: names, import order, line length)
over the package, the tests and the benchmarks; shown to fail on a planted long line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("ruff", reason="the lint test needs ruff (bash scripts/setup.sh --test "
                                   "installs it)")


def ruff(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *paths],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_code_is_clean():
    done = ruff("src", "tests", "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_long_line_fails_it(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "long.py").write_text(f"x = {'1 + ' * 40}1\n")
    done = ruff("long.py", cwd=tmp_path)
    assert done.returncode == 1 and "E501" in done.stdout, done.stdout + done.stderr
