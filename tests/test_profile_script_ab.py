"""A script's verdict measured and proved with no edit to the script: the levers kasoku sets
from outside (``--with``: ``kasoku.commands.script_levers``), each side a fresh run of the
script stopped after its timed steps (``kasoku.commands.script_ab``), and the input bound
proved by replaying the DataLoader's first batches."""
from __future__ import annotations

import json
import os
import textwrap
from dataclasses import replace

import pytest
import torch
from test_profile_script import MNIST, kasoku, write
from torch.utils.data import DataLoader

from kasoku.advisor.levers import Lever
from kasoku.advisor.verdict import Experiment, Verdict
from kasoku.cli import main
from kasoku.commands import ab
from kasoku.commands.script_launch import parse_launched
from kasoku.commands.script_levers import ScriptFacts
from kasoku.commands.script_offers import script_candidates, script_experiments
from kasoku.core.errors import ConfigError
from kasoku.perf.profile.figures import StepFigures

LEVERS = """
import sys
import pytest
import pytest
import torch
from torch.utils.data import DataLoader

class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i))

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
loader = DataLoader(Numbers(), batch_size=2)
print("workers", loader.num_workers, "threads", torch.get_num_threads(), "pin",
      loader.pin_memory, "persistent", loader.persistent_workers, "prefetch",
      loader.prefetch_factor)
for x in loader:
    out = model(x)
    print("first", int(x[0, 0]), "dtype", str(out.dtype))
    out.float().sum().backward()
    opt.step()
"""


@pytest.mark.slow  # the script run on each side of the A/B rounds: about 14 s on 2 cores
def test_the_replay_proves_a_textbook_loop_input_bound(tmp_path):
    write(tmp_path, "train.py", MNIST)
    run = kasoku("profile", "--skip", "3", "--measure-steps", "10", "--warmup", "1",
                 "--steps", "3", "--estimate", "--rounds", "1", "--confirm",
                 "--stop-after-window", "--out", "prof", "--", "python", "train.py", "1000",
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""  # stopped after the window, before its last print
    result = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert result["verdict"]["rule"] == "input-bound"
    rows = {row["label"]: row for row in result["ladder"]}
    replay = rows["replayed batches (no wait for data)"]
    assert replay["outcome"] == "confirmed" and replay["ratio"] > 2, replay
    assert replay["command"].startswith("kasoku profile --skip 3 --measure-steps 10 --with "
                                        "replay -- python train.py 1000")
    assert "confirmed (the bound)" in run.stderr
    assert result["facts"]["loader_site"] == "train.py:27"
    assert result["facts"]["forward_site"] == "train.py:32"  # model(x)


def test_with_levers_reach_the_script_and_a_side_stops_after_its_timed_steps(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "levers.py", LEVERS)
    threads = torch.get_num_threads()
    code = main(["profile", "--skip", "2", "--measure-steps", "3", "--measure-seconds", "0.001",
                 "--measure-only", "--out", "side", "--with", "threads=1", "--with", "workers=1",
                 "--with", "bf16", "--with", "replay", "--with", "pin-memory",
                 "--with", "persistent-workers", "--with", "prefetch=3", "--", "python",
                 "levers.py"])
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "workers 1 threads 1 pin True persistent True prefetch 3"
    # 2 skipped steps, then the first two batches in turn; the 5th step's opt.step() ends it
    assert [line.split()[1] for line in out[1:]] == ["0", "2", "0", "2", "0"]
    assert {line.split()[3] for line in out[1:]} == {"torch.bfloat16"}
    measured = json.loads((tmp_path / "side" / "measure.json").read_text())
    assert measured["measured_steps"] == 3 and measured["samples_per_step"] == 2
    assert measured["levers"] == ["threads=1", "workers=1", "bf16", "replay", "pin-memory",
                                  "persistent-workers", "prefetch=3"]
    assert len(measured["window_rates"]) == 3 and measured["samples_per_s"] > 0
    assert torch.get_num_threads() == threads and not torch.is_autocast_enabled("cpu")
    assert DataLoader(list(range(4))).num_workers == 0


def test_the_verdicts_levers_in_the_scripts_terms():
    facts = ScriptFacts(loader_site="train.py:12", forward_site="train.py:30", has_conv=True,
                        loader_steps=True, batch_size=128)
    verdict = Verdict.from_dict({
        "rule": "device-bound (compute-bound)", "reason": "",
        "lever": {"text": "", "expect": ""}, "candidates": [
            {"text": "tensor cores in bf16: --precision bf16", "expect": "estimate ~2.0x",
             "args": ["--precision", "bf16"], "speedup": 2.0},
            {"text": "NHWC convolutions: --channels-last", "expect": "estimate ~1.3x",
             "args": ["--channels-last"]},
            {"text": "something kasoku's workloads alone have: --fused-bn", "expect": "",
             "args": ["--fused-bn"]}],
        "experiments": [{"label": "synthetic data on the device", "faster": False,
                         "args": ["--synthetic", "--loader", "device"]},
                        {"label": "batch x2 (256)", "args": ["--batch-size", "256"],
                         "faster": False}]})
    levers = script_candidates(verdict, facts, "cuda")
    # NHWC convolutions pulled from outside too (a model with convolutions); --fused-bn has no
    # words for a script: left out
    assert [lever.args for lever in levers] == [("--with", "bf16"), ("--with", "channels-last"),
                                                ("--with", "tf32"), ("--with", "cudnn-benchmark")]
    assert levers[0].text == ("bf16: torch.autocast('cuda', dtype=torch.bfloat16) around the "
                              "forward and the loss (the forward: train.py:30)")
    # a model without: the edit, not measured
    edit = script_candidates(verdict, replace(facts, has_conv=False), "cuda")[-1]
    assert edit.args == () and edit.text.endswith("(needs an edit: not measured)")
    # batches copied from pageable memory, 6% of the step: pinned memory is offered
    copies = StepFigures(step_ms=10.0, h2d_ms=0.6, h2d_pageable=True)
    (pinned,) = [lever for lever in script_candidates(verdict, facts, "cuda", copies)
                 if lever.args == ("--with", "pin-memory")]
    assert "pin_memory=True) at train.py:12" in pinned.text
    # a script already in bf16, or on TF32, is not offered them again
    done = ScriptFacts(autocast="bfloat16", tf32=True)
    assert script_candidates(replace(verdict, candidates=[]), done, "cuda") == []
    kept, left = script_experiments(verdict, facts)
    assert kept == [Experiment("replayed batches (no wait for data)", {"with.replay": True},
                               False)]
    assert kept[0].args == ("--with", "replay")
    assert left == ["batch x2 (256)"]
    # nothing to replay where the steps take no batch from a DataLoader
    kept, left = script_experiments(verdict, ScriptFacts(loader_steps=False))
    assert kept == [] and left == ["synthetic data on the device", "batch x2"]


def test_confirm_calls_a_large_effect_despite_noisy_rounds():
    """Rounds 25% apart cannot hide a 30x effect, but can one of 1.15x against the 1.10x
    threshold."""
    rates = {(): iter([100.0, 125.0]), ("--with", "replay"): iter([3000.0, 3900.0]),
             ("--with", "tf32"): iter([115.0, 144.0])}
    experiments = [Experiment("replay", {"with.replay": True}, True),
                   Experiment("tf32", {"with.tf32": True}, True)]

    def measure(extra):
        rate = next(rates[tuple(extra)])
        return {"samples_per_s": rate, "phases": {}, "window_rates": [rate]}
    rows = ab.confirm([], experiments, Lever("", ""), rounds=2, measure=measure,
                      command=lambda args: " ".join(args), say=lambda line: None)
    by = {row["label"]: row for row in rows}
    assert by["replay"]["outcome"] == "confirmed"
    assert by["tf32"]["outcome"].startswith("inconclusive")
    assert by["replay"]["command"] == "--with replay"


def test_a_side_whose_script_fails_is_not_measured(tmp_path):
    write(tmp_path, "flaky.py", textwrap.dedent("""
        import sys
        sys.exit("no data here")
    """))
    from kasoku.commands.profile import ProfileConfig
    from kasoku.commands.script_ab import ScriptSides
    from kasoku.commands.script_run import parse_command
    sides = ScriptSides(parse_command(["python", str(tmp_path / "flaky.py")]),
                        ProfileConfig(skip=1, measure_steps=2), [])
    assert sides.measure(()) == {"error": "the script exited with code 1 before its first "
                                          "step"}


DDP_SCRIPT = """
import os
import sys
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Slow(Dataset):
    # about 2 ms of work per sample, made on demand
    def __len__(self):
        return 512

    def __getitem__(self, i):
        x = torch.full((64, 64), i / 512)
        for _ in range(40):
            x = torch.tanh(x @ x)
        return x[0], i % 10


torch.set_num_threads(1)
dist.init_process_group("gloo")
model = DDP(nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = Slow()
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
try:
    for step, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
finally:
    dist.destroy_process_group()
print(f"rank {os.environ['RANK']} done")
"""


def torchrun_profile(tmp_path, *options):
    write(tmp_path, "ddp.py", DDP_SCRIPT)
    run = kasoku("profile", "--skip", "2", "--measure-steps", "4", "--warmup", "1",
                 "--steps", "2", *options, "--stop-after-window", "--out", "prof", "--",
                 "torchrun", "--nproc-per-node", "2", "--standalone", "ddp.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "done" not in run.stdout  # both ranks stopped after the window
    assert run.stderr.count("kasoku: ddp.py: 4 steps timed on cpu") == 1  # rank 0 speaks
    return run, json.loads((tmp_path / "prof" / "profile.json").read_text())


def test_a_scripts_own_ddp_under_torchrun_is_profiled_on_every_rank(tmp_path):
    run, result = torchrun_profile(tmp_path, "--estimate")
    assert result["steps_seen"] == 10 and result["settings"]["batch_size"] == 8
    assert (tmp_path / "prof" / "worker1" / "trace.json").is_file()  # rank 1's own window
    # the collectives of DDP's gradient all-reduce are in rank 0's figures
    assert result["figures"]["comm_pct"] > 0
    assert "verdict (estimate: no lever measured)" in run.stderr


@pytest.mark.slow  # 28 s: three torchruns of 2 workers
def test_a_torchrun_scripts_levers_are_measured_in_torchruns_of_their_own(tmp_path):
    run, result = torchrun_profile(tmp_path, "--rounds", "1")
    # the lever kasoku pulls from outside, measured in a torchrun of its own beside the
    # script as given (the step waits for its DataLoader, whatever its bound)
    tried = {tuple(t["args"]): t for t in result["verdict"]["tried"]}
    workers = tried[("--with", f"workers={min(4, len(os.sched_getaffinity(0)))}")]
    assert workers["ratio"] is not None and len(workers["rates"]) == 1, workers
    assert f"{workers['ratio']:.2f}x" in run.stderr


def test_torchrun_options_are_read_by_torchrun():
    launched = parse_launched(["torchrun", "--nproc-per-node=2", "--standalone", "-m",
                               "json.tool", "--sort-keys"])
    assert launched.options == ("--nproc-per-node=2", "--standalone")
    assert launched.script.module == "json.tool" and launched.script.args == ("--sort-keys",)
    assert parse_launched(["python", "train.py"]) is None
    with pytest.raises(ConfigError, match="--no-python runs no Python script"):
        parse_launched(["torchrun", "--no-python", "echo"])
