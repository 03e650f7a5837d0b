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


SLOW_LOADER = textwrap.dedent("""
    import os
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    # as a logger does (Lightning's lightning_logs/version_N): a new folder in the working
    # directory for each run
    os.makedirs("logs", exist_ok=True)
    os.makedirs(f"logs/version_{len(os.listdir('logs'))}")


    class Slow(Dataset):  # each sample takes 3 ms to make: worker processes pay off
        def __len__(self):
            return 320

        def __getitem__(self, i):
            time.sleep(0.003)
            return torch.randn(16, generator=torch.Generator().manual_seed(i)), i % 2


    torch.manual_seed(0)
    loader = DataLoader(Slow(), batch_size=8)
    model = torch.nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"done: {loader.num_workers} workers")
""")


def test_auto_keeps_what_was_measured_faster_and_runs_the_script_whole(tmp_path):
    # An input-bound script: the profile measures worker processes faster, the whole run
    # takes them, and the last line says what was kept, by how much, with its spread.
    (tmp_path / "slow.py").write_text(SLOW_LOADER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    run = subprocess.run([sys.executable, "-m", "kasoku", "run", "--auto", "--skip", "2",
                          "--measure-steps", "6", "--measure-seconds", "0.2", "--warmup", "1",
                          "--steps", "2", "--rounds", "1", "--", "python", "slow.py"],
                         cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    assert list((tmp_path / "runs").glob("*/profile.json"))
    # the profile and its tries ran in scratch folders: the one run in the user's is the whole
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["version_0"]
    last = run.stderr.strip().splitlines()[-1]
    # What the profile measured decides (on a busy machine one round may call it noise); what
    # it kept is what the whole run took, and its output is the run's alone.
    if last.startswith("kasoku: kept --with workers=2: measured "):
        assert run.stdout == "done: 2 workers\n"
        assert last.endswith("beside the script as given; workers=2 changes what the script "
                             "computes, not its arithmetic")
    else:
        assert last.startswith("kasoku: no lever kept: none was measured faster (tried: "
                               "workers=2 "), run.stderr
        assert run.stdout == "done: 0 workers\n"


def test_auto_keeps_nothing_that_was_not_measured_faster_and_says_why():
    from kasoku.commands.script_auto import kept_line
    tried = [{"args": ["--with", "threads=1"], "ratio": 0.62, "result": "slower"}]
    assert kept_line([], None, tried) == ("no lever kept: none was measured faster (tried: "
                                          "threads=1 0.62x, slower)")
    assert kept_line([], None, None) == "no lever kept: the profile did not finish"
    # measured faster, but its losses moved: dropped, and the line says so, not "none faster"
    tried = [{"args": ["--with", "bf16"], "ratio": 1.4, "result": "faster"}]
    assert kept_line([], None, tried, "bf16 faster, but changes the losses by 4.8%: not kept") \
        == "no lever kept: bf16 faster, but changes the losses by 4.8%: not kept (tried: bf16 " \
           "1.40x, faster)"


def test_auto_or_with_not_both(script, capsys):
    assert main(["run", "--auto", "--with", "bf16", "--", "python", "train.py"]) == 2
    assert capsys.readouterr().err == ("kasoku: error: --auto chooses the levers itself: give "
                                       "--auto or --with, not both\n")


class Sides:
    """A side measured at a fixed rate: the script as given 100 samples/s, with every lever
    given ``together`` samples/s."""

    def __init__(self, together: float):
        self.together = together

    def measure(self, extra=()):
        rate = self.together if extra else 100.0
        return {"samples_per_s": rate, "window_rates": [rate] * 5}


TRIED = [{"args": ["--with", "workers=2"], "ratio": 1.8, "ratios": [1.7, 1.9], "noise": 0.05,
          "result": "faster"},
         {"args": ["--with", "bf16"], "ratio": 1.3, "ratios": [1.25, 1.35], "noise": 0.05,
          "result": "faster"},
         {"args": ["--with", "threads=1"], "ratio": 0.7, "result": "slower"}]


def test_several_faster_levers_are_kept_together_only_where_that_is_faster_still(capsys):
    from kasoku.commands.script_auto import choose
    kept, proof = choose(TRIED, Sides(together=240.0), rounds=2)
    assert kept == ["workers=2", "bf16"] and proof["ratio"] == pytest.approx(2.4)
    kept, proof = choose(TRIED, Sides(together=150.0), rounds=2)  # 1.5x: less than 1.8x
    assert kept == ["workers=2"] and proof is TRIED[0]
    assert choose(TRIED[2:], Sides(together=500.0), rounds=2) == ([], None)


class Losses:
    """Sides that report their timed steps' losses: as given (or with the levers that keep the
    arithmetic) ``base``, a second time ``again``, with every lever ``side``."""

    def __init__(self, base, again, side):
        self.runs = [base, again, side]

    def measure(self, extra=()):
        return {"samples_per_s": 100.0, "window_rates": [100.0] * 5,
                "losses": self.runs.pop(0)}


def test_a_lever_that_changes_the_arithmetic_is_kept_only_where_the_losses_stay():
    from kasoku.commands.script_auto import check_losses
    base = [2.30, 2.10, 1.90]
    kept, said = check_losses(["workers=2", "bf16"], Losses(base, base, [2.301, 2.102, 1.903]))
    assert kept == ["workers=2", "bf16"]
    assert said == "the losses of the timed steps within 0.14% of the run without bf16"
    kept, said = check_losses(["workers=2", "bf16"], Losses(base, base, [2.30, 2.20, 1.90]))
    assert kept == ["workers=2"] and said == "bf16 faster, but changes the losses by 4.8%: not kept"
    kept, said = check_losses(["bf16"], Losses(base, [2.4, 2.0, 1.7], base))
    assert kept == ["bf16"] and said.startswith("the losses were not compared: two runs without "
                                                "the levers differ by 9.5%")
    assert check_losses(["workers=2"], Losses(base, base, base)) == (["workers=2"], None)
    # a loss trained towards zero: its last steps' digits are no measure of the training
    low = [2.0, 0.5, 0.02, 0.01]
    kept, said = check_losses(["bf16"], Losses(low, low, [2.001, 0.503, 0.01, 0.02]))
    assert kept == ["bf16"] and said.endswith("within 1.58% of the run without bf16")


def test_a_side_reports_its_timed_steps_losses(script, tmp_path):
    # The side --auto compares: each timed step's loss, in order, as the script computed it.
    out = tmp_path / "side"
    assert main(["profile", "--skip", "1", "--measure-steps", "3", "--measure-only", "--out",
                 str(out), "--", "python", "train.py"]) == 0
    import json
    measured = json.loads((out / "measure.json").read_text())
    # a side times --measure-seconds at least: here to the script's end, 5 steps after 1
    assert len(measured["losses"]) == measured["measured_steps"] >= 3
    assert all(0.3 < x < 1.5 for x in measured["losses"])


class Rates:
    """Sides whose rate is the product of each lever's factor (the levers compound: bf16 makes
    the layout matter): 100 samples/s as given."""

    FACTORS = {"bf16": 1.5, "channels-last": 1.4, "compile": 1.3, "tf32": 0.99}

    def __init__(self, command, cfg, given):
        self.given = list(given)

    def measure(self, extra=()):
        from kasoku.commands.script_auto import values_of
        rate = 100.0
        for value in self.given + values_of(extra):
            rate *= self.FACTORS[value]
        return {"samples_per_s": rate, "window_rates": [rate] * 5}


def test_auto_climbs_each_profile_with_the_levers_kept_so_far(script, monkeypatch, tmp_path,
                                                                 capsys):
    # Each profile measures its verdict's levers on top of those kept so far: bf16 first, then
    # the layout and compiling that bf16 makes worth it; a lever kept already is not kept twice.
    from kasoku.commands import script_auto
    from kasoku.commands.profile_config import ProfileConfig
    from kasoku.commands.script_run import parse_command

    def tried(*pairs):
        return [{"args": ["--with", v], "ratio": r, "result": "faster" if r > 1.1 else "slower"}
                for v, r in pairs]

    profiles = {(): tried(("bf16", 1.5), ("channels-last", 1.0), ("tf32", 0.99)),
                ("bf16",): tried(("bf16", 1.0), ("channels-last", 1.4)),
                ("bf16", "channels-last"): tried(("compile", 1.3)),
                ("bf16", "channels-last", "compile"): tried(("tf32", 0.99))}
    seen = []

    def profile_tries(command, cfg, given, out):
        seen.append((tuple(given), out.name))
        return profiles[tuple(given)]

    monkeypatch.setattr(script_auto, "profile_tries", profile_tries)
    monkeypatch.setattr(script_auto, "ScriptSides", Rates)
    kept, proof, first = script_auto.climb(parse_command(["python", "train.py"]),
                                           ProfileConfig(rounds=2), tmp_path / "p")
    assert kept == ["bf16", "channels-last", "compile"]
    assert proof["ratio"] == pytest.approx(1.5 * 1.4 * 1.3) and proof["result"] == "faster"
    assert first == profiles[()]
    assert seen == [((), "p"), (("bf16",), "with-1-levers"),
                    (("bf16", "channels-last"), "with-2-levers")]  # CLIMBS profiles at most
    err = capsys.readouterr().err
    assert "measuring bf16, channels-last together beside the script as given:" in err
    # a lever faster on top but not together against the script as given ends the climb
    monkeypatch.setattr(Rates, "measure", lambda self, extra=(): {
        "samples_per_s": 100.0 if len(self.given + script_auto.values_of(extra)) != 1
        else 150.0, "window_rates": [100.0] * 5})
    kept, proof, _ = script_auto.climb(parse_command(["python", "train.py"]),
                                       ProfileConfig(rounds=2), tmp_path / "q")
    assert kept == ["bf16"]
