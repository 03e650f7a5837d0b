"""``kasoku run [--with LEVER ...] -- python train.py``: a user's script run whole with levers
set from outside it (``kasoku.commands.script_with``): the levers take effect, the script's
output and exit code are its own (byte for byte where no lever is given), one closing line."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kasoku.cli import main

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randint(2, (96,)))
    loader = DataLoader(data, batch_size=32)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch} loss {loss.item():.6f} workers {loader.num_workers} "
              f"threads {torch.get_num_threads()}")
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return path


def test_the_levers_take_effect_and_the_exit_code_is_the_script_s(script, capsys):
    code = main(["run", "--with", "threads=1", "--with", "workers=1", "--", "python",
                 "train.py", "3"])
    out, err = capsys.readouterr()
    assert code == 3
    assert out.splitlines()[-1].endswith("workers 1 threads 1")
    assert "--with threads=1 changes what the script computes" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kasoku: train.py ended with exit code 3 with --with threads=1 "
                           "--with workers=1: 6 training steps in ")


def test_as_given_the_output_is_the_script_s_byte_for_byte(script):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    alone = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True,
                           env=env, timeout=120)
    run = subprocess.run([sys.executable, "-m", "kasoku", "run", "--", "python", "train.py"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == alone.returncode == 0
    assert run.stdout == alone.stdout and "epoch 1 loss" in run.stdout
    assert run.stderr.strip().splitlines()[-1].startswith(
        "kasoku: train.py ran to its end with no lever (as given): 6 training steps in ")


def test_a_script_that_raises_shows_its_traceback_and_says_it_failed(tmp_path, monkeypatch,
                                                                     capsys):
    (tmp_path / "bad.py").write_text("def f():\n    raise RuntimeError('the data is gone')\nf()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--", "python", "bad.py"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: the data is gone" in err and "kasoku/commands" not in err
    assert err.strip().splitlines()[-1].startswith(
        "kasoku: bad.py failed with no lever (as given): 0 training steps in ")


@pytest.mark.parametrize("argv, says", [
    (["run", "--with", "replay", "--", "python", "train.py"],
     "kasoku: error: --with replay trains on the DataLoader's first batches again and again"),
    (["run", "--with", "bogus", "--", "python", "train.py"],
     "kasoku: error: --with bogus: not a lever kasoku sets from outside a script"),
    (["run"], "kasoku: error: give the script's command after --: kasoku run --with bf16 -- "
              "python train.py"),
    (["run", "--", "python", "missing.py"], "kasoku: error: "),
])
def test_mistakes_are_one_line(script, capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
