"""What a script's profile counts as its steps (``kasoku.commands.script_watch.StepWatch``):
one step per ``step()`` of the first optimizer that steps, whatever the backward passes
between (two losses and two optimizers, gradient accumulation, a closure's passes inside
``LBFGS.step``); one step per backward pass only for a script that updates by hand. Each
script is tiny and runs on the CPU in this process (``kasoku.cli.main``); a run too short for
the window says how many steps it counted over the whole script."""
from __future__ import annotations

import json
import textwrap

import pytest

from kasoku.cli import main
from kasoku.commands.script_watch import UNUSED_OPTIMIZER

WINDOW = ["--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps", "3", "--estimate"]
"""9 steps: 2 skipped, 2 timed, 1 profiler warm-up, the anchor, 3 analysed (steps 7-9)."""

HAND = """
import sys
import torch
torch.manual_seed(0)
w = torch.randn(16, 4, requires_grad=True)
x, y = torch.randn(32, 16), torch.randn(32, 4)
if sys.argv[3:] == ["unused"]:  # an optimizer made, never stepped
    opt = torch.optim.SGD([w], lr=0.01)
n = int(sys.argv[1])
for step in range(n):
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    w.data -= 0.01 * w.grad
    w.grad = None
print("hand iterations", n)
sys.exit(int(sys.argv[2]))
"""

GAN = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
G, D = nn.Linear(4, 8), nn.Linear(8, 1)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
n = int(sys.argv[1])
for i in range(n):
    # three backward passes an iteration, D's two before its step: DCGAN's loop
    opt_d.zero_grad()
    bce(D(torch.randn(16, 8)), ones).backward()
    fake = G(torch.randn(16, 4))
    bce(D(fake.detach()), zeros).backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(D(fake), ones).backward()
    opt_g.step()
print("gan iterations", n)
sys.exit(int(sys.argv[2]))
"""

LBFGS = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5)
x, y = torch.randn(64, 8), torch.randn(64, 1)
calls = 0


def closure():
    global calls
    calls += 1
    opt.zero_grad()
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    return loss


n = int(sys.argv[1])
for i in range(n):
    opt.step(closure)
print("lbfgs iterations", n, "closure calls", calls)
sys.exit(int(sys.argv[2]))
"""

ACCUMULATE = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
m = nn.Linear(8, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
n = int(sys.argv[1])
for i in range(n):
    for micro in range(4):
        ((m(torch.randn(8, 8)) - 1) ** 2).mean().div(4).backward()
    opt.step()
    opt.zero_grad()
print("accumulated iterations", n)
sys.exit(int(sys.argv[2]))
"""

CLOSURE = """
import sys
import time
import torch
from torch import nn
torch.manual_seed(0)


class SlowBackward(torch.autograd.Function):  # a backward pass of 30 ms, a forward of 60 ms
    @staticmethod
    def forward(ctx, x):
        time.sleep(0.06)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad


m = nn.Linear(8, 1)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
x, y = torch.randn(16, 8), torch.randn(16, 1)


def closure():  # as Lightning's: the forward, the loss and the backward inside step()
    opt.zero_grad()
    loss = ((SlowBackward.apply(m(x)) - y) ** 2).mean()
    loss.backward()
    return loss


n = int(sys.argv[1])
for i in range(n):
    if sys.argv[3:] == ["positional"]:  # LBFGS's examples' step(closure)
        opt.step(closure)
    else:  # Lightning's
        opt.step(closure=closure)
print("closure iterations", n)
sys.exit(int(sys.argv[2]))
"""

SCRIPTS = {"hand": HAND, "gan": GAN, "lbfgs": LBFGS, "accumulate": ACCUMULATE,
           "closure": CLOSURE}


def run(folder, capsys, name: str, *args: str, window=WINDOW) -> tuple[int, str, str]:
    """``kasoku profile WINDOW --out prof -- python NAME.py ARGS`` here: its exit code, the
    script's stdout and kasoku's stderr."""
    (folder / f"{name}.py").write_text(textwrap.dedent(SCRIPTS[name]))
    code = main(["profile", *window, "--out", "prof", "--", "python", f"{name}.py", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"closure"}))
def test_a_whole_script_counts_one_step_an_iteration(in_tmp, capsys, name):
    # 5 iterations, fewer than the window's 9 steps: kasoku says how many it counted
    code, out, err = run(in_tmp, capsys, name, "5", "3")
    assert code == 3  # the script's own exit code
    assert out.startswith(f"{name if name != 'accumulate' else 'accumulated'} iterations 5")
    assert err == ("kasoku: the script ended after 5 steps, before the window's end (--skip 2, "
                   "--measure-steps 2, --warmup 1, --steps 3: 9 steps): ask for fewer\n")
    if name == "lbfgs":  # the closure ran more than once a step: its passes are that step's
        assert int(out.split()[-1]) > 10


def test_a_hand_written_update_skips_one_step(in_tmp, capsys):
    window = ["--skip", "1", *WINDOW[2:]]  # 8 steps: the 1st skipped, steps 6-8 analysed
    code, out, err = run(in_tmp, capsys, "hand", "10", "0", window=window)
    assert code == 0, err
    assert out == "hand iterations 10\n"
    assert "Traceback" not in err
    assert "kasoku: hand.py: 2 steps timed on cpu" in err and "steps 6-8 profiled" in err
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    assert result["steps_seen"] == 8 and result["profiled_steps"] == [6, 8]
    assert result["figures"]["steps"] == 3


@pytest.mark.parametrize("name", ["gan", "lbfgs", "accumulate"])
def test_the_window_profiles_optimizer_steps(in_tmp, capsys, name):
    code, out, err = run(in_tmp, capsys, name, "12", "0")
    assert code == 0, err
    assert out.startswith(f"{name if name != 'accumulate' else 'accumulated'} iterations 12")
    assert "steps 7-9 profiled" in err
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    assert result["steps_seen"] == 9 and result["figures"]["steps"] == 3
    # an optimizer's step is the update, however many backward passes came before it
    assert result["figures"]["phases_host_ms"]["update"] > 0


def test_an_optimizer_that_never_steps_leaves_the_backward_passes_as_steps(in_tmp, capsys):
    code, out, err = run(in_tmp, capsys, "hand", str(UNUSED_OPTIMIZER + 5), "0", "unused")
    assert code == 2  # it ended well, before the window: the command asked for too much
    assert out == f"hand iterations {UNUSED_OPTIMIZER + 5}\n"
    # the passes while its optimizers might yet step are not steps; those after are
    assert err.startswith("kasoku: the script ended after 5 steps, before the window's end")


@pytest.mark.parametrize("passed", ["keyword", "positional"])
def test_a_closure_s_forward_and_backward_are_its_step_s_not_the_update(in_tmp, capsys, passed):
    # Lightning's step: optimizer.step(closure) runs the forward, the loss and the backward
    # inside the optimizer's step; only what follows the closure is the optimizer's update.
    code, out, err = run(in_tmp, capsys, "closure", "12", "0", passed)
    assert code == 0, err
    assert out == "closure iterations 12\n"
    result = json.loads((in_tmp / "prof" / "profile.json").read_text())
    assert result["steps_seen"] == 9
    phases = result["figures"]["phases_host_ms"]
    assert phases["forward"] >= 55 and 25 <= phases["backward"] < 55, phases
    assert 0 < phases["update"] < 25, phases  # Adam's arithmetic on 9 numbers
