"""What each lever kasoku sets from outside a script (``--with``) does to what the script
computes: the script's losses step by step under the lever against the run as given from the
same seed, in this process through ``kasoku.cli.main`` (a measuring side: 2 steps skipped, 8
timed, then the script is stopped). A lever that legitimately changes the arithmetic is
allowed the difference its note (``script_levers.NUMERICS``) says, and no more."""
from __future__ import annotations

import json

import pytest
import torch
from test_profile_script import write

from kasoku.advisor.levers import Lever
from kasoku.advisor.script import ScriptVerdict
from kasoku.advisor.verdict import Verdict
from kasoku.cli import main
from kasoku.commands import script_apply
from kasoku.commands.script_levers import NUMERICS, ScriptFacts, numerics
from kasoku.commands.script_offers import script_lever
from kasoku.commands.script_profile import verdict_lines

TRAIN = """
import contextlib
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
written = "--autocast" in sys.argv  # bf16 as a person writes it into the script


class Points(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(512, 32, generator=g)
        self.y = self.x[:, :4].argmax(1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Head(nn.Module):
    # kept in fp32 under any autocast, as scripts keep a sensitive layer: its backward's
    # products are fp32 too
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 4) * 0.1)

    def forward(self, h):
        with torch.autocast(device, enabled=False):
            return h.float() @ self.w


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                      Head()).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
loader = DataLoader(Points(), batch_size=32, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        bf16 = torch.autocast(device, dtype=torch.bfloat16) if written else contextlib.nullcontext()
        with bf16:
            loss = nn.functional.cross_entropy(model(x), y)
        print(f"loss {loss.item():.9g}", flush=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

STEPS = 10
"""2 skipped, 8 timed: the measuring side stops the script in its 10th optimizer step."""


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "train.py", TRAIN)
    return tmp_path


def losses(capsys, levers=(), args=()) -> list[float]:
    """The script's losses under ``levers`` (``--with`` values), its own ``args`` after."""
    argv = ["profile", "--skip", "2", "--measure-steps", str(STEPS - 2), "--measure-seconds",
            "0.001", "--measure-only",
            "--out", "side"]
    for value in levers:
        argv += ["--with", value]
    assert main([*argv, "--", "python", "train.py", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    found = [float(line.split()[1]) for line in out if line.startswith("loss ")]
    assert len(found) == STEPS, out
    return found


def worst(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_trains_as_autocast_written_around_the_forward_and_the_loss(script, capsys,
                                                                          device):
    """One autocast block around the whole script kept the first step's bf16 weights for
    every forward (its cache is dropped only when the outermost block exits): the losses of
    the lever must follow autocast written into the script, step by step, and learn."""
    dev = ["--device", device]
    as_given = losses(capsys, args=dev)
    written = losses(capsys, args=[*dev, "--autocast"])
    lever = losses(capsys, ["bf16"], args=dev)
    assert lever == written  # the same casts, the same order: bit for bit
    assert 1e-5 < worst(lever, as_given) < 0.02  # bf16's rounding, not another training
    assert lever[-1] < lever[0] - 0.2  # it learns (stale weights did not: 1.36 -> 1.36)
    assert not torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value,allowed,noted", [
    ("pin-memory", 0.0, False),  # the same values, copied from page-locked memory
    # the dataset draws no random numbers: the same batches in the same order (one that does
    # draws them in the workers: the note)
    ("workers=2", 0.0, True),
    ("cudnn-benchmark", 0.0, True),  # no convolution to pick an algorithm for
    ("threads=1", 1e-6, True),  # products summed in another order at most
    ("tf32", None, True),  # nothing on the CPU; on the GPU TF32's 10-bit mantissa
    ("fused-optimizer", 1e-6, True),  # the same update in another order at most
])
def test_a_lever_changes_the_losses_no_more_than_it_says(script, capsys, device, value,
                                                         allowed, noted):
    dev = ["--device", device]
    as_given = losses(capsys, args=dev)
    lever = losses(capsys, [value], args=dev)
    if allowed is None:
        allowed = 0.0 if device == "cpu" else 0.01
    assert worst(lever, as_given) <= allowed
    assert bool(numerics(value)) == noted


def test_replay_trains_on_other_batches_and_says_so(script, capsys):
    as_given = losses(capsys)
    argv = ["profile", "--skip", "2", "--measure-steps", "8", "--measure-seconds", "0.001",
            "--measure-only", "--out", "side",
            "--with", "replay", "--", "python", "train.py"]
    assert main(argv) == 0
    replayed = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert replayed[:2] == as_given[:2]  # the skipped steps take the loader's batches
    assert worst(replayed[2:], as_given[2:]) > 0.01  # then the first two again and again
    # a person who asks for it is told, before the script's first line
    assert main(["profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "2", "--estimate", "--stop-after-window", "--out", "prof", "--with", "replay",
                 "--with", "bf16", "--", "python", "train.py"]) == 0
    err = capsys.readouterr().err
    assert "kasoku: --with replay changes what the script computes: the steps train on the " \
           "DataLoader's first batches again and again" in err
    assert "kasoku: --with bf16 changes what the script computes" in err


def test_advice_that_changes_the_arithmetic_carries_its_note():
    facts = ScriptFacts(forward_site="train.py:30")
    bf16 = script_lever(Lever("bf16: --precision bf16", "estimate ~2.0x",
                              {"accel.precision": "bf16"}, 2.0), facts, "cuda")
    assert bf16.args == ("--with", "bf16") and bf16.caveat == NUMERICS["bf16"]
    threads = script_lever(Lever("one thread: --threads 1", "estimate: unknown",
                                 {"train.threads": 1}), facts, "cpu")
    assert threads.caveat == NUMERICS["threads"]
    # the advice says it under the verdict
    result = {"verdict": ScriptVerdict(Verdict("device-bound", "busy", bf16), measured=True),
              "out": "prof", "report": "prof/report.html"}
    assert f"  note: {NUMERICS['bf16']}" in verdict_lines(result)


CONV = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
for step in range(20):
    loss = nn.functional.cross_entropy(model(x), y)
    print(f"loss {loss.item():.9g}", flush=True)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("value", [
    "channels-last",  # other convolution algorithms on NHWC
    # inductor's fused kernels: 25 s on 2 cores with its cache cold
    pytest.param("compile", marks=[pytest.mark.slow, pytest.mark.skipif(
        script_apply.compiler_missing("cpu") is not None, reason="needs g++")]),
])
def test_a_convolutional_models_lever_changes_its_losses_in_their_last_digits(
        tmp_path, monkeypatch, capsys, value):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "train.py", CONV)
    as_given = losses(capsys)
    lever = losses(capsys, [value])
    assert "error" not in json.loads((tmp_path / "side" / "measure.json").read_text())  # applied
    # seen: 1.2e-7 (channels-last), 0 (compile): fp32's last digits
    assert worst(lever, as_given) <= 1e-5 and numerics(value)
    assert lever[-1] < lever[0]  # it learns
