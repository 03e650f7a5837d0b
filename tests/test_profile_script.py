"""``kasoku profile -- python SCRIPT.py``: an unchanged training script profiled in-process
(``kasoku.commands.script_profile``). The scripts are written here; a real process runs the
textbook loop and the failing script (stdout, stderr and exit code as a user sees them), the
rest run in this process through ``kasoku.cli.main``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from kasoku.cli import main
from kasoku.commands.script_watch import LOADER_ITER

WINDOW = ["--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps", "3", "--estimate"]
"""9 steps: 2 skipped, 2 timed, 1 profiler warm-up, the anchor, 3 analysed (steps 7-9); no
A/B runs (tests/test_profile_script_ab.py runs them)."""

MNIST = """
import sys
import warnings
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    # Each sample made on demand, as a decoding dataset would: about 1 ms of numpy per item.
    def __len__(self):
        return 256

    def __getitem__(self, i):
        img = np.random.default_rng(i).random((96, 96), dtype=np.float32)
        for _ in range(24):
            img = np.tanh(img @ img.T / 96)
        return torch.from_numpy(img[::3, ::3].copy()).reshape(-1), i % 10


def main():
    torch.set_num_threads(1)  # a busy CI core slows 2 threads' products 10x, not the loading
    steps = int(sys.argv[1])
    model = nn.Sequential(nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Digits(), batch_size=16, shuffle=True, num_workers=0)
    warnings.warn("the script's own warning")
    done = 0
    while done < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    print(f"script: trained {done} steps")


if __name__ == "__main__":
    main()
"""

HAND_SGD = """
import torch
torch.manual_seed(0)
w = torch.randn(32, 8, requires_grad=True)
x, y = torch.randn(64, 32), torch.randn(64, 8)
for step in range(12):
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
        w.grad = None
print("hand sgd done")
"""

STEPS_THEN = """
import sys
import torch
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
try:
    for i in range(int(sys.argv[1])):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        print("step", i + 1)
finally:
    print("finally ran")
print("after the loop")
sys.exit(int(sys.argv[2]))
"""

FAILS_AT_4 = """
import torch
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(1, 10):
    if i == 4:
        raise RuntimeError(f"out of data at step {i}")
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
"""

RAISES = """
import torch

def build_model():
    raise ValueError("a mistake in the script")

build_model()
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def kasoku(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m kasoku ARGS`` in a real process run from ``cwd``."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-m", "kasoku", *args], cwd=cwd, env=env, check=False,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_textbook_loop_reads_input_bound(tmp_path):
    write(tmp_path, "train.py", MNIST)
    run = kasoku("profile", *WINDOW, "--out", "prof", "--", "python", "train.py", "12",
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "script: trained 12 steps\n"  # the script's own output, alone
    ours = [line for line in run.stderr.splitlines() if line.startswith("kasoku: ")]
    # said when the window ends, the script's own line after it: it runs on to its end
    assert ours[0].startswith("kasoku: the profile's window ended at step 9; the script runs on")
    assert ours[1].startswith("kasoku: train.py: 2 steps timed on cpu")
    # the profiled steps beside the unprofiled: the profiler's cost, or why it is not resolved
    assert re.search(r"steps 7-9 profiled \([0-9.]+ ms per profiled step against [0-9.]+ "
                     r"unprofiled: .*\)$", ours[1]), ours[1]
    assert "verdict (estimate: no lever measured): input-bound" in run.stderr
    # the advice is a change to the script, at the line that makes the DataLoader
    assert "DataLoader(..., num_workers=" in run.stderr and ") at train.py:27" in run.stderr
    assert "UserWarning: the script's own warning" in run.stderr  # as Python prints it
    assert "kasoku: warning" not in run.stderr
    result = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert result["verdict"]["rule"] == "input-bound"
    assert result["figures"]["data_pct"] > 50
    assert result["script"] == ["python", "train.py", "12"]
    assert result["steps_seen"] == 9 and not result["stopped_after_window"]
    assert result["settings"]["loader"] == "serial" and result["settings"]["batch_size"] == 16
    # the step's phases as a workload's: the wait, then forward, backward and the update
    assert list(result["figures"]["phases_host_ms"]) == ["data", "forward", "backward",
                                                          "update"]
    for name in ("trace.json", "report.html"):
        assert (tmp_path / "prof" / name).is_file()


def test_a_script_that_raises_shows_its_own_traceback(tmp_path):
    write(tmp_path, "broken.py", RAISES)
    run = kasoku("profile", "--out", "prof", "--", "broken.py", cwd=tmp_path)
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-2] == "ValueError: a mistake in the script"
    assert lines[-1] == "kasoku: the script failed before its first step"
    assert "kasoku" not in "\n".join(lines[:-1]) and "runpy" not in run.stderr
    assert 'line 7, in <module>' in run.stderr and 'in build_model' in run.stderr


def test_a_hand_written_update_steps_at_each_backward(in_tmp, capsys):
    write(in_tmp, "sgd.py", HAND_SGD)
    before = (torch.Tensor.backward, torch.autograd.backward, LOADER_ITER.__next__,
              DataLoader.__init__, torch.autocast.__enter__)
    assert main(["profile", *WINDOW, "--out", "prof", "--", "python", "sgd.py"]) == 0
    out, err = capsys.readouterr()
    assert out == "hand sgd done\n"
    assert "kasoku: sgd.py: 2 steps timed on cpu" in err and "steps 7-9 profiled" in err
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    assert result["figures"]["steps"] == 3 and result["steps_seen"] == 9
    # no optimizer: the update is what follows the backward pass
    assert {"forward", "backward", "update"} <= set(result["figures"]["phases_host_ms"])
    assert (torch.Tensor.backward, torch.autograd.backward, LOADER_ITER.__next__,
            DataLoader.__init__, torch.autocast.__enter__) == before


def test_a_script_that_ends_before_the_window(in_tmp, capsys):
    write(in_tmp, "short.py", STEPS_THEN)
    argv = sys.argv[:]
    assert main(["profile", *WINDOW, "--out", "prof", "--", "short.py", "3", "5"]) == 5
    out, err = capsys.readouterr()
    assert out.splitlines()[-2:] == ["finally ran", "after the loop"]
    assert err.strip() == ("kasoku: the script ended after 3 steps, before the window's end "
                           "(--skip 2, --measure-steps 2, --warmup 1, --steps 3: 9 steps): "
                           "ask for fewer")
    assert sys.argv == argv
    # ... and one that ends well is a command to change: exit 2
    assert main(["profile", *WINDOW, "--out", "prof2", "--", "short.py", "3", "0"]) == 2


def test_a_script_that_raises_mid_run_failed_rather_than_ended(in_tmp, capsys):
    write(in_tmp, "fails.py", FAILS_AT_4)
    assert main(["profile", *WINDOW, "--", "fails.py"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[-2] == "RuntimeError: out of data at step 4"
    assert lines[-1] == ("kasoku: the script failed after 3 steps, before the window's end: "
                         "nothing was profiled")
    # the run folder it made, left empty, is gone
    assert not (in_tmp / "runs").exists() or not list((in_tmp / "runs").iterdir())


def test_stop_after_window_ends_the_script_cleanly(in_tmp, capsys):
    write(in_tmp, "long.py", STEPS_THEN)
    code = main(["profile", *WINDOW, "--stop-after-window", "--out", "prof", "--",
                 "python", "long.py", "1000", "0"])
    out, err = capsys.readouterr()
    assert code == 0
    # The 9th step's opt.step() ends the script: its print, and what follows the loop,
    # never happen; its finally does.
    assert out.splitlines() == [*(f"step {i}" for i in range(1, 9)), "finally ran"]
    assert "the script stopped after the window" in err
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    assert result["stopped_after_window"] and result["steps_seen"] == 9


def test_an_error_after_the_window_keeps_the_profile(in_tmp, capsys):
    write(in_tmp, "fails.py", STEPS_THEN)
    assert main(["profile", *WINDOW, "--out", "prof", "--", "fails.py", "11", "4"]) == 4
    err = capsys.readouterr().err
    assert "kasoku: the script exited with code 4 after the window; the profile is kept" in err
    assert json.loads((in_tmp / "prof" / "profile.json").read_text())["script_exit_code"] == 4


@pytest.mark.parametrize(("argv", "says"), [
    (["--", "python", "missing.py"], "the script missing.py does not exist"),
    (["mnist-mlp", "--", "python", "x.py"], "give a workload or a script after --, not both"),
    (["--"], "give the script's command after --"),
    (["--python", "--", "x.py"], "--python is not yet for a script"),
    (["--with", "fast", "--", "x.py"], "--with fast: not a lever kasoku sets from outside"),
    (["--with", "workers=two", "--", "x.py"], "--with workers=two: workers=N takes a whole"),
    (["mnist-mlp", "--with", "tf32"], "--with is for a script"),
    (["--loader", "serial", "--", "x.py"], "--loader is not yet for a script"),
    (["--device", "cpu", "--", "x.py"], "--device is not for a script"),
    (["mnist-mlp", "--stop-after-window"], "--stop-after-window is for a script"),
    (["--", "python", "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
])
def test_command_mistakes_are_one_line(in_tmp, capsys, argv, says):
    write(in_tmp, "x.py", "print('never run')\n")
    assert main(["profile", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err, err


def test_a_script_without_a_step(in_tmp, capsys):
    write(in_tmp, "idle.py", "print('no training here')\n")
    assert main(["profile", "--out", "prof", "--", "idle.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "no training here\n"
    assert err == ("kasoku: the script ended without a training step (no optimizer step, "
                   "no backward pass): nothing to profile\n")


INTERRUPTS = """
import os
import signal
import sys
import torch
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(int(sys.argv[1])):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    if i + 1 == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C at this step
print("never")
"""


@pytest.mark.parametrize(("at", "says"), [
    ("4", "kasoku: interrupted after 4 steps, before the window's end: nothing was profiled"),
    ("12", "kasoku: interrupted: the levers were not measured"),
])
def test_ctrl_c_ends_the_profile_with_130_and_says_what_was_kept(in_tmp, capsys, at, says):
    write(in_tmp, "stop.py", INTERRUPTS)
    code = main(["profile", *WINDOW[:-1], "--out", "prof", "--", "stop.py", "50", at])
    out, err = capsys.readouterr()
    assert code == 130 and "never" not in out
    assert says in err, err
    assert (in_tmp / "prof" / "profile.json").is_file() == (at == "12")
