"""Several machines, played on one host: each "machine" is one launcher invocation of its own
(one worker each, gloo on the CPU), started the ways docs/distributed.md gives. kasoku's own
launcher (``--nnodes 2 --node-rank 0/1 --rdzv-endpoint``, the static rendezvous) is
tests/test_dist.py's ``test_two_machines_on_one_host_train_together``; here: ``torchrun`` with
PyTorch's c10d rendezvous backend starting ``python -m kasoku train`` as its workers, and a
scheduler's environment as the Slurm line of the docs sets it. Each must train as one job of
2 workers: the weights of one process on the whole batch (in float64, as tests/test_dist.py
explains), worker 0 alone speaking for a world of 2."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist
from test_dist import ATOL_FP64, MLP64, MNIST, assert_same, weights

from kasoku.distributed import ddp
from kasoku.distributed.failures import peer_lost

# What a launcher or a scheduler tells its workers: none of it may leak from the test's own
# environment into a "machine".
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
           "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")

# docs/distributed.md's Slurm line runs this in every task before kasoku.
SLURM_EXPORTS = "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID"

TWO_WORKERS = "2 processes (gloo), batch 30 per worker, 60 in all"


@pytest.fixture(scope="module")
def mlp64(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("workload") / "mlp64.py"
    path.write_text(MLP64)
    return f"{path}:MnistMLP64"


@pytest.fixture(scope="module")
def one_process(mlp64, tmp_path_factory) -> Path:
    """The reference: one process on the whole batch of 60 for one epoch."""
    out = tmp_path_factory.mktemp("one") / "run"
    done = subprocess.run([sys.executable, "-m", "kasoku", "train", mlp64, *MNIST[1:],
                           "--batch-size", "60", "--epochs", "1", "--out", str(out)],
                          env=_clean_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    return dict(env, PYTHONUNBUFFERED="1", **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_machines(commands: list[list[str]], envs: list[dict], logs: Path,
                 timeout: float = 120) -> list[str]:
    """Start every command at once, each in a process group of its own (a machine: its
    launcher and the workers it starts), and wait for all; returns their stderr texts. Past
    ``timeout`` seconds every group is killed and the test fails: a rendezvous that never
    completes waits 10 to 15 minutes by default."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"machine{i}.err" for i in range(len(commands))]
    procs: list[subprocess.Popen] = []
    try:
        for command, env, path in zip(commands, envs, paths):
            with open(path, "w") as err:  # files, not pipes: a full pipe would stall a machine
                procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                              stderr=err, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the machines did not finish within {timeout} s:\n{_tails(logs)}")
    finally:
        _kill_all(procs)
    errs = [p.read_text() for p in paths]
    assert [proc.returncode for proc in procs] == [0] * len(procs), \
        "\n".join(e[-3000:] for e in errs)
    return errs


def torchrun_c10d(port: int, job: str, *train_argv, max_restarts: int = 0) -> list[str]:
    """One machine's torchrun of a 2-machine job, one worker here, the c10d rendezvous at
    ``localhost:PORT``, its workers ``python -m kasoku TRAIN_ARGV``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"localhost:{port}", "--rdzv-id", job, "--max-restarts", str(max_restarts),
            "-m", "kasoku", *map(str, train_argv)]


def assert_one_job_of_two(errs: list[str], run: Path, one_process: Path) -> None:
    said = "".join(errs)
    # One world of 2: worker 0 names it, once; two jobs of one worker would each say
    # "1 processes" (or train alone, with no such line at all).
    assert said.count(TWO_WORKERS) == 1, said[-3000:]
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1]["iteration"] == 20  # 1,200 samples, 60 a step: 30 from each worker
    assert_same(weights(run), weights(one_process), rtol=0, atol=ATOL_FP64)


def test_torchrun_with_the_c10d_rendezvous_runs_kasoku_as_its_workers(tmp_path, mlp64,
                                                                      one_process):
    port = _free_port()
    run = tmp_path / "run"
    train = ["train", mlp64, *MNIST[1:], "--batch-size", "30", "--epochs", "1", "--out", run]
    errs = run_machines([torchrun_c10d(port, f"test-{port}", *train) for _ in range(2)],
                        [_clean_env()] * 2, tmp_path / "logs")
    assert_one_job_of_two(errs, run, one_process)


def test_the_slurm_line_runs_kasoku_as_one_job(tmp_path, mlp64, one_process):
    # What srun gives each task (one task on each of two machines), then the docs' exports.
    port = _free_port()
    run = tmp_path / "run"
    worker = [sys.executable, "-m", "kasoku", "train", mlp64, *MNIST[1:], "--batch-size", "30",
              "--epochs", "1", "--out", str(run)]
    envs = [_clean_env(SLURM_PROCID=str(task), SLURM_NTASKS="2", SLURM_LOCALID="0",
                       MASTER_ADDR="localhost", MASTER_PORT=str(port)) for task in (0, 1)]
    errs = run_machines([["bash", "-c", f'{SLURM_EXPORTS}; exec "$@"', "task", *worker]] * 2,
                        envs, tmp_path / "logs")
    assert_one_job_of_two(errs, run, one_process)


def _join(store, world_size: int, ranks: list[int], stagger_s: float = 0.0) -> list[tuple]:
    """What ``ddp._agree_on_attempt`` gives the workers of ``ranks``, threads that start in
    that order ``stagger_s`` apart."""
    def worker(i: int) -> tuple:
        time.sleep(i * stagger_s)
        return ddp._agree_on_attempt(store, ranks[i], world_size, 20)

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(worker, range(len(ranks))))


def test_the_workers_of_an_attempt_agree_on_its_number_and_none_is_used_twice(monkeypatch):
    store = dist.TCPStore("localhost", 0, 1, is_master=True, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=20))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _join(store, 2, [0, 1]) == [(0, 0)] * 2
    # A restart that no launcher counted (torchrun's c10d, a membership change), then one
    # that one launcher counted: the launcher's count is told beside the agreed number.
    assert _join(store, 2, [1, 0]) == [(1, 0)] * 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _join(store, 2, [0, 1]) == [(2, 1)] * 2
    # A group that never formed: its worker 1 sat at attempt 3 and died before worker 0
    # came. Worker 0 of the next group finds seat 0 of attempt 3 free; worker 1 finds its
    # seat taken and moves both on.
    store.set(f"{ddp.ATTEMPTS}/latest", "3")
    store.add(f"{ddp.ATTEMPTS}/3/rank1", 1)
    store.set(f"{ddp.ATTEMPTS}/3/restarts1", "0")
    store.add(f"{ddp.ATTEMPTS}/3/of2/seated", 1)
    assert _join(store, 2, [0, 1], stagger_s=0.5) == [(4, 1)] * 2
    # A larger world: rank 2 has no seat at attempt 4 yet, and still joins the others at 5.
    assert _join(store, 3, [2, 0, 1], stagger_s=0.5) == [(5, 1)] * 3


SLEEPER = textwrap.dedent('''
    import os, time
    from pathlib import Path
    import torch
    from torch import nn
    from kasoku import ArrayDataset, Recipe, Workload

    # Each worker of each attempt, before it joins: its rank and the launcher's restart count.
    with open(os.environ["ATTEMPTS"], "a") as f:
        f.write(f"{os.environ['RANK']} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")

    class Sleepy(nn.Linear):
        calls = 0
        def forward(self, x):
            self.calls += 1
            if self.training and self.calls == 30 and os.environ["RANK"] == "0" \\
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                Path(os.environ["SLEEPING"]).write_text(str(os.getpid()))
                time.sleep(10)  # busy outside any collective while its peer dies
            return super().forward(x)

    class Slow(Workload):
        recipe = Recipe(optimizer="sgd", lr=0.1, batch_size=4, epochs=1)
        generated_data = True
        def build_model(self):
            return Sleepy(8, 2)
        def build_datasets(self, data, seed=0):
            x = torch.randn(256, 8, generator=torch.Generator().manual_seed(seed))
            return ArrayDataset(x, (x[:, 0] > 0).long()), None
        def loss_fn(self, out, y):
            return nn.functional.cross_entropy(out, y)
    ''')


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_c10d_restarts_the_job_once(tmp_path):
    (tmp_path / "slow.py").write_text(SLEEPER)
    port, run = _free_port(), tmp_path / "run"
    sleeping, attempts = tmp_path / "sleeping", tmp_path / "attempts"
    train = ["train", f"{tmp_path / 'slow.py'}:Slow", "--no-progress", "--snapshot-interval",
             "20", "--dist-timeout", "5", "--out", run]
    env = _clean_env(SLEEPING=str(sleeping), ATTEMPTS=str(attempts))
    logs = tmp_path / "logs"
    logs.mkdir()
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(open(logs / f"machine{i}.err", "w")) for i in range(2)]
        machines: list[subprocess.Popen] = []
        stack.callback(_kill_all, machines)
        machines += [subprocess.Popen(
            torchrun_c10d(port, f"test-{port}", *train, max_restarts=3), env=env,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True) for err in errs]
        deadline = time.monotonic() + 90
        while not sleeping.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not sleeping.exists():  # not the failure this test expects: pytest.fail
            pytest.fail("worker 0 never reached its sleep:\n" + _tails(logs))
        time.sleep(0.1)  # the file exists a moment before the pid is in it
        rank0 = int(sleeping.read_text())
        peers = [pid for m in machines for pid in _workers(m.pid) if pid != rank0]
        if len(peers) != 1:
            pytest.fail(f"expected worker 1 beside worker 0 ({rank0}), found {peers}")
        os.kill(peers[0], signal.SIGKILL)  # worker 1 dies while worker 0 is between steps
        codes = [m.wait(timeout=150) for m in machines]
    started = attempts.read_text()
    said = "".join(path.read_text() for path in sorted(logs.iterdir())) + \
        "\nrank, restart count of each worker started:\n" + started
    assert codes == [0, 0], said
    # One restart, though torchrun counts it on machine 1 alone (seen: the second attempt's
    # workers at restart counts 0 and 1): two attempts of two workers, the second joined at
    # once and resumed, and the run ended.
    assert len(started.splitlines()) == 4, said
    assert said.count("(restart 1)") == 1 and "resumed from" in said, said
    assert json.loads((run / "log.jsonl").read_text().splitlines()[-1])["iteration"] == 32
    # Worker 1's death is the only failure. Worker 0 of the first attempt, stopped by its
    # launcher while it slept, may finish its step and say that it lost its peer (under
    # torchrun a worker has no kasoku launcher to leave that note to); nothing else fails.
    errors = [line for line in said.splitlines() if line.startswith("kasoku: error")]
    assert len(errors) <= 1 and all(line.startswith("kasoku: error: worker 0: ") and
                                    peer_lost(RuntimeError(line)) for line in errors), said


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill the process group of every one still running (a launcher and its workers)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tails(logs: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(logs.iterdir()))


def _workers(pid: int) -> list[int]:
    """The kasoku worker processes the launcher ``pid`` started."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"kasoku" in argv:
                out.append(int(entry.name))
    return out
