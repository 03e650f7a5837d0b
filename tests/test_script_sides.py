"""A script's profile and its A/B sides on real tiny scripts: the loader's operators in the
step's thread counted as the wait for data (``kasoku.perf.profile.trace``), each side run in
a scratch folder, timed long enough, and ``--confirm`` that says why it has no rows
(``kasoku.commands.script_ab``)."""
from __future__ import annotations

import json

from test_profile_script import write

from kasoku.cli import main

LOADER_OPS = """
import torch
from torch.utils.data import DataLoader, Dataset

MEAN, STD = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.2, 0.2])


class Images(Dataset):
    # ToTensor and Normalize written with torch operators: about 45 small operators per
    # sample, run in the step's thread (no workers)
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        img = torch.full((8, 8, 3), i % 256, dtype=torch.uint8)
        x = img.permute(2, 0, 1).contiguous().to(torch.float32).div(255)
        for c in range(3):
            x[c].sub_(MEAN[c]).div_(STD[c])
        return x.reshape(-1), i % 10


model = torch.nn.Sequential(torch.nn.Linear(192, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Images(), batch_size=32, num_workers=0):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_loaders_operators_are_the_wait_for_data_not_the_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "train.py", LOADER_OPS)
    assert main(["profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "2", "--estimate", "--stop-after-window", "--out", "prof", "--", "python",
                 "train.py"]) == 0
    result = json.loads((tmp_path / "prof" / "profile.json").read_text())
    f = result["figures"]
    # the model's operators (3 products forward, their gradients, the loss, SGD): about 160;
    # the loader's 32 samples of ToTensor/Normalize: about 1,450, apart
    # (the rule itself is not asserted: on a busy core any small step can read latency-bound)
    assert f["ops_per_step"] < 400 < 1000 < f["data_ops_per_step"], f
    # the loading is the wait for data: its operators' time is in the data phase
    assert f["phases_host_ms"]["data"] > 0.5 and f["profiled"]["data_pct"] > 0.5, f


SIDE_EFFECTS = """
import os
import torch

scale = float(open("data/scale.txt").read())  # an input, relative to the working directory
os.makedirs("logs", exist_ok=True)
run = f"logs/version_{len(os.listdir('logs'))}"  # as a logger numbers its runs
os.makedirs(run)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(50):
    (model(torch.ones(8, 4)) * scale).sum().backward()
    opt.step()
    with open(f"{run}/metrics.txt", "a") as f:
        f.write(f"{step}\\n")
"""


def test_a_side_runs_in_a_scratch_folder_its_inputs_resolved(tmp_path, monkeypatch):
    from kasoku.commands.profile import ProfileConfig
    from kasoku.commands.script_ab import ScriptSides
    from kasoku.commands.script_run import parse_command
    user = tmp_path / "user"
    (user / "data").mkdir(parents=True)
    (user / "data" / "scale.txt").write_text("2.0")
    (user / "logs" / "version_0").mkdir(parents=True)  # the user's own run
    write(user, "train.py", SIDE_EFFECTS)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    monkeypatch.chdir(user)
    sides = ScriptSides(parse_command(["python", "train.py"]),
                        ProfileConfig(skip=1, measure_steps=2), [])
    measured = sides.measure(())
    assert measured.get("samples_per_s", 0) > 0, measured  # data/scale.txt was read
    # the side's logs/version_1 went with its folder; the user's folder is as it was
    assert sorted(p.relative_to(user).as_posix() for p in user.rglob("*")) == [
        "data", "data/scale.txt", "logs", "logs/version_0", "train.py"]
    assert list(scratch.iterdir()) == []


FAST = """
import sys
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("trained", step + 1)
"""


def test_a_sides_timed_steps_last_the_measure_seconds(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "fast.py", FAST)
    side = ["profile", "--skip", "2", "--measure-steps", "3", "--measure-seconds", "0.3",
            "--measure-only"]
    assert main([*side, "--out", "long", "--", "python", "fast.py", "1000000"]) == 0
    measured = json.loads((tmp_path / "long" / "measure.json").read_text())
    # 3 steps of a fraction of a millisecond: timed for the 0.3 s instead, in 5 windows or more
    assert measured["measured_steps"] > 30 and measured["measure_s"] >= 0.3, measured
    assert len(measured["window_rates"]) >= 5
    # a script that ends first: its steps timed to its end (8 after the 2 skipped)
    assert main([*side, "--out", "short", "--", "python", "fast.py", "10"]) == 0
    measured = json.loads((tmp_path / "short" / "measure.json").read_text())
    assert measured["measured_steps"] == 8 and measured["samples_per_s"] > 0
    assert "trained 10" in capsys.readouterr().out
    # ... unless it ends before the steps asked
    assert main([*side, "--out", "none", "--", "python", "fast.py", "4"]) != 0
    assert not (tmp_path / "none" / "measure.json").exists()


def test_confirm_with_nothing_to_run_says_why_not_a_bare_header(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "fast.py", FAST)  # no DataLoader: no batches to replay, nothing measured
    assert main(["profile", "--skip", "2", "--measure-steps", "3", "--warmup", "1", "--steps",
                 "2", "--estimate", "--confirm", "--stop-after-window", "--out", "prof", "--",
                 "python", "fast.py", "1000"]) == 0
    err = capsys.readouterr().err
    assert "confirming the bound" not in err and "confirm (fresh processes" not in err
    assert "kasoku: --confirm: nothing to run in fresh runs of the script: " in err, err
    assert json.loads((tmp_path / "prof" / "profile.json").read_text())["ladder"] == []
