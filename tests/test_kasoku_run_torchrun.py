"""``kasoku run --with LEVER -- torchrun OPTIONS train.py ARGS`` (and ``--auto``): the script's
own DDP run whole under torchrun with kasoku run in each worker, the levers set in every one,
its output and exit code torchrun's, and one closing line from the launching process with the
steps worker 0 counted (``kasoku.commands.script_with.run_launched``). Real torchruns of two
gloo workers on the CPU: each takes 15-30 s on a busy 2-core machine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_profile_script import kasoku, write

from kasoku.cli import main
from kasoku.commands import script_auto, script_with
from kasoku.commands.script_ab import ScriptSides

DDP = """
import os
import sys
import time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.manual_seed(0)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(96, 8), torch.randint(2, (96,)))
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
stop_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
# one write a line (end=""): under PYTHONUNBUFFERED the line and its newline are two, and the
# two workers' lines would interleave
print(f"rank {rank} pid {os.getpid()}\\n", end="", flush=True)
try:
    for step, (x, y) in enumerate(loader):
        if step == stop_at and rank == 1 and sys.argv[1] == "fail":
            sys.exit(3)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f} "
              f"threads {torch.get_num_threads()}\\n", end="", flush=True)
        if step + 1 == stop_at and (rank == 0 or sys.argv[1] == "wait"):
            time.sleep(120)  # torchrun stops it: worker 1 failed, or Ctrl-C
finally:
    dist.destroy_process_group()
"""
TORCHRUN = ("torchrun", "--nproc-per-node", "2", "--standalone", "ddp.py")


def closing(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "under torchrun" in line]


@pytest.mark.slow  # one torchrun of two workers: 15-30 s
def test_the_levers_are_set_in_every_worker_and_worker_0_counts_the_steps(tmp_path):
    write(tmp_path, "ddp.py", DDP)
    run = kasoku("run", "--with", "threads=2", "--", *TORCHRUN, "run", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for rank in (0, 1):  # torchrun sets 1 thread per worker; the lever 2, in each
        steps = [line for line in lines if line.startswith(f"rank {rank} step ")]
        assert len(steps) == 6 and all(line.endswith("threads 2") for line in steps)
    assert "rank 0 step 5 loss " in run.stdout
    said = closing(run.stderr)
    assert len(said) == 1 and said == run.stderr.strip().splitlines()[-1:]
    assert said[0].startswith("kasoku: ddp.py under torchrun ran to its end with --with "
                              "threads=2: 6 training steps (worker 0's) in ")
    assert run.stderr.count("--with threads=2 changes what the script computes") == 1


@pytest.mark.slow  # one torchrun of two workers: 15-30 s
def test_a_worker_that_fails_ends_the_run_with_torchruns_exit_code(tmp_path):
    # Worker 1 exits with 3 at its third step while worker 0 waits after its second:
    # torchrun stops worker 0 (SIGTERM), which says its count first, and exits 1.
    write(tmp_path, "ddp.py", DDP)
    run = kasoku("run", "--with", "threads=2", "--", *TORCHRUN, "fail", "2", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "exitcode  : 3" in run.stderr  # torchrun's own summary of the failure
    assert "rank 0 step 1 " in run.stdout and "rank 0 step 2 " not in run.stdout
    said = closing(run.stderr)
    assert len(said) == 1 and said == run.stderr.strip().splitlines()[-1:]
    assert said[0].startswith("kasoku: ddp.py under torchrun ended with exit code 1 with "
                              "--with threads=2: 2 training steps (worker 0's) in ")


@pytest.mark.slow  # one torchrun of two workers: 15-30 s
def test_ctrl_c_stops_torchrun_and_its_workers_with_torchruns_exit_code(tmp_path):
    write(tmp_path, "ddp.py", DDP)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kasoku", "run", "--", *TORCHRUN,
                                 "wait", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
        seen = []
        for line in proc.stdout:  # both workers wait after their second step
            seen.append(line)
            if sum(line.startswith(f"rank {r} step 1 ") for r in (0, 1) for line in seen) == 2:
                break
        proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches kasoku alone
        seen += proc.stdout.readlines()
        assert proc.wait(timeout=60) == 1  # torchrun's code after a SIGINT
    err = (tmp_path / "stderr").read_text()
    said = closing(err)
    assert len(said) == 1 and said == err.strip().splitlines()[-1:]
    assert said[0].startswith("kasoku: ddp.py under torchrun was interrupted with no lever "
                              "(as given): 2 training steps (worker 0's) in ")
    pids = [int(line.split()[3]) for line in seen if " pid " in line]
    assert len(pids) == 2
    for pid in pids:  # torchrun stopped them before it ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_auto_under_torchrun_profiles_measures_and_runs_under_torchrun(tmp_path, monkeypatch,
                                                                      capsys):
    # The profiles are kasoku profile -- torchrun ... (profile_launched), the second with the
    # lever kept by the first; each measuring side is a torchrun of its own (the launcher);
    # the whole run too, with the closing line once.
    write(tmp_path, "ddp.py", DDP)
    monkeypatch.chdir(tmp_path)
    started = []

    def run_in_session(cmd, env=None, stdout=None, cwd=None):
        started.append(cmd)
        if "profile" in cmd:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            tried = [{"args": ["--with", "threads=2"], "ratio": 1.5, "ratios": [1.5],
                      "noise": 0.01, "result": "faster"}]
            (out / "profile.json").write_text(json.dumps({"verdict": {"tried": tried}}))
        else:
            Path(env[script_with.RUN_COUNT]).write_text(json.dumps(
                {"steps": 12, "elapsed_s": 3.0, "how": "ran to its end", "code": 0}))
        return 0, []
    launchers = []

    def measure(self, extra=()):
        launchers.append(self.launcher)
        return {"samples_per_s": 100.0, "window_rates": [100.0], "losses": [0.7, 0.6]}
    monkeypatch.setattr(script_with, "run_in_session", run_in_session)
    monkeypatch.setattr(script_auto, "run_in_session", run_in_session)
    monkeypatch.setattr(ScriptSides, "measure", measure)
    assert main(["run", "--auto", "--", *TORCHRUN, "run"]) == 0
    profile, again, whole = started
    assert profile[profile.index("--"):] == ["--", *TORCHRUN, "run"]
    assert again[again.index("--with"):] == ["--with", "threads=2", "--", *TORCHRUN, "run"]
    assert len(launchers) == 3 and all(
        launcher[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node" in launcher
        for launcher in launchers)  # the losses compared: as given twice, with the lever
    assert whole[1:3] == ["-m", "torch.distributed.run"]
    assert whole[whole.index("kasoku"):] == ["kasoku", "run", "--with", "threads=2", "--",
                                             "python", "ddp.py", "run"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(closing("\n".join(err))) == 1
    assert err[-2] == ("kasoku: ddp.py under torchrun ran to its end with --with threads=2: "
                       "12 training steps (worker 0's) in 3.0 s (4.0 steps/s)")
    assert err[-1].startswith("kasoku: kept --with threads=2: measured 1.50x")


def test_torchrun_inside_torchrun_is_refused(tmp_path, monkeypatch, capsys):
    write(tmp_path, "ddp.py", DDP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert main(["run", "--", *TORCHRUN]) == 2
    assert "kasoku: error: torchrun inside torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("code, exits", [(1, 1), (0, 130)])  # torchrun's after a Ctrl-C;
def test_ctrl_c_during_autos_profile_stops_there(tmp_path, monkeypatch, capsys, code, exits):
    # a profile whose measuring side alone was stopped ends well: 130 then
    write(tmp_path, "ddp.py", DDP)
    monkeypatch.chdir(tmp_path)
    started = []

    def run_in_session(cmd, env=None, stdout=None, cwd=None):
        started.append(cmd)
        return code, [signal.SIGINT]
    monkeypatch.setattr(script_auto, "run_in_session", run_in_session)
    assert main(["run", "--auto", "--", *TORCHRUN]) == exits
    assert len(started) == 1  # the profile's, no whole run after it
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kasoku: interrupted while profiling: the script was not run whole")


CHILD = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(7))
pathlib.Path(sys.argv[1]).touch()
time.sleep(60)
"""


def test_a_signal_is_passed_on_once_and_the_child_waited_for(tmp_path):
    # kasoku's own Ctrl-C (a terminal's reaches kasoku alone: the child is in a session of
    # its own) goes on to the child, which ends as it will; kasoku waits and gets its code.
    import threading
    import time

    from kasoku.commands.script_launch import run_in_session
    ready = tmp_path / "ready"

    def interrupt():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    assert run_in_session([sys.executable, "-c", CHILD, str(ready)]) == (7, [signal.SIGINT])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_worker_0_that_said_nothing_leaves_a_line_without_a_count(tmp_path, monkeypatch,
                                                                   capsys):
    # Worker 0 killed outright (SIGKILL, out of memory): torchrun's code, and no count.
    write(tmp_path, "ddp.py", DDP)
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(script_with, "run_in_session",
                        lambda cmd, env=None, stdout=None: (started.append(cmd), (1, []))[1])
    assert main(["run", "--with", "workers=1", "--", "python", "-m", "torch.distributed.run",
                 "--nproc-per-node", "2", "ddp.py", "run"]) == 1
    assert started[0][started[0].index("kasoku"):] == [
        "kasoku", "run", "--with", "workers=1", "--", "python", "ddp.py", "run"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kasoku: ddp.py under torchrun ended with exit code 1 with --with "
                           "workers=1: no count of steps from worker 0, ")
