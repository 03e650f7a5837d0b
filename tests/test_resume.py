"""Resume equivalence: a run cut anywhere and resumed ends bit-identical to an uninterrupted
one (dropout on the global RNG, Adam, a warmup+cosine schedule, mid-epoch and mid-interval
cuts), in-process and across real processes killed by SIGKILL or stopped by SIGTERM."""
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from kasoku.data.base import ArrayDataset
from kasoku.data.loader import SerialLoader
from kasoku.train import (
    CosineLR,
    Evaluator,
    LinearWarmup,
    LogReport,
    ManualScheduleTrigger,
    Snapshot,
    Trainer,
    load_snapshot,
)

TOTAL_ITERATIONS = 20  # 6 iterations per epoch: the run ends mid-epoch 4


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def build(out, stop, snapshot_trigger, device="cpu", at_end=True):
    torch.manual_seed(0)
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    dataset = ArrayDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = Trainer(model, optimizer, SerialLoader(dataset, 16, seed=3),
                      nn.functional.cross_entropy, metric_fn=accuracy,
                      device=device, stop_trigger=(stop, "iteration"), out=out)
    trainer.extend(LinearWarmup(0.5, inner=CosineLR(4, min_lr=1e-3)))
    trainer.extend(Evaluator(dataset, model, nn.functional.cross_entropy, accuracy))
    trainer.extend(LogReport(trigger=(4, "iteration")))
    trainer.extend(Snapshot(trigger=snapshot_trigger, at_end=at_end))
    return trainer


def test_a_finished_run_snapshots_its_end_and_resumes_from_it_exactly(tmp_path, reference):
    # Stopped by its trigger at 13, between log lines (every 4) and snapshots (at 6): the log
    # gets a final, partial line and the folder a snapshot of iteration 13, from which the run
    # goes on as if it had never stopped.
    whole, whole_log = reference
    first = build(tmp_path, 13, ManualScheduleTrigger(6, "iteration"))
    first.run()
    lines = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(e["iteration"], e.get("final", False)) for e in lines] == \
        [(4, False), (8, False), (12, False), (13, True)]
    assert load_snapshot(tmp_path / "snapshot_latest.pt")["updater"]["iteration"] == 13
    resumed = build(tmp_path, TOTAL_ITERATIONS, None)
    resumed.run(resume=tmp_path / "snapshot_latest.pt")
    assert_same_state(whole.model.state_dict(), resumed.model.state_dict())
    lines = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert without_time(lines) == without_time(json.loads(s) for s in whole_log.splitlines())


def without_time(log):
    """The entries less their wall-clock figures (elapsed time, the phases' times)."""
    return [{k: v for k, v in e.items() if k != "elapsed_time" and not k.startswith("time/")}
            for e in log]


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    trainer = build(out, TOTAL_ITERATIONS, None)
    trainer.run()
    return trainer, (out / "log.jsonl").read_text()


@pytest.mark.parametrize("k", [1, 6, 9, 14])
def test_resume_in_process_is_bit_identical(tmp_path, reference, k):
    whole, whole_log = reference
    # The first run snapshots at k and goes on a little (as a killed run would have: no
    # snapshot at its end), so the resumed run must also drop the log lines written after it.
    first = build(tmp_path, min(k + 5, TOTAL_ITERATIONS - 1), ManualScheduleTrigger(k, "iteration"),
                  at_end=False)
    first.run()
    resumed = build(tmp_path, TOTAL_ITERATIONS, None)
    resumed.run(resume=tmp_path / "snapshot_latest.pt")
    assert resumed.updater.iteration == TOTAL_ITERATIONS
    assert_same_state(whole.model.state_dict(), resumed.model.state_dict())
    assert whole.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]
    assert without_time(whole.get_extension("LogReport").log) == \
        without_time(resumed.get_extension("LogReport").log)
    lines = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert without_time(lines) == without_time(json.loads(s) for s in whole_log.splitlines())
    assert resumed.updater.elapsed_time >= load_snapshot(
        tmp_path / "snapshot_latest.pt")["updater"]["elapsed_time"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_on_cuda_is_bit_identical(tmp_path):
    whole = build(tmp_path / "whole", TOTAL_ITERATIONS, None, device="cuda")
    whole.run()
    first = build(tmp_path, 12, ManualScheduleTrigger(9, "iteration"), device="cuda")
    first.run()
    resumed = build(tmp_path, TOTAL_ITERATIONS, None, device="cuda")
    resumed.run(resume=tmp_path / "snapshot_latest.pt")
    assert_same_state(whole.model.state_dict(), resumed.model.state_dict())
    assert without_time(whole.get_extension("LogReport").log) == \
        without_time(resumed.get_extension("LogReport").log)


def test_resume_from_the_final_snapshot_does_nothing(tmp_path):
    trainer = build(tmp_path, 6, (1, "iteration"))
    trainer.run()
    again = build(tmp_path, 6, (1, "iteration"))
    again.run(resume=tmp_path / "snapshot_latest.pt")
    assert again.updater.iteration == 6
    assert_same_state(trainer.model.state_dict(), again.model.state_dict())


SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from torch import nn
    from kasoku.data.base import ArrayDataset
    from kasoku.data.loader import SerialLoader
    from kasoku.train import CosineLR, LinearWarmup, LogReport, Snapshot, Trainer

    out, resume, sleep_s = Path(sys.argv[1]), sys.argv[2] == "resume", float(sys.argv[3])
    torch.manual_seed(0)
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    dataset = ArrayDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = Trainer(model, optimizer, SerialLoader(dataset, 16, seed=3),
                      nn.functional.cross_entropy, stop_trigger=(40, "iteration"), out=out)
    trainer.extend(LinearWarmup(0.5, inner=CosineLR(6)))
    trainer.extend(LogReport(trigger=(5, "iteration")))
    trainer.extend(Snapshot(trigger=(1, "iteration")))
    trainer.extend(lambda t: time.sleep(sleep_s), name="sleep")
    try:
        trainer.run(resume=out / "snapshot_latest.pt" if resume else None)
    except KeyboardInterrupt as exc:
        print(exc, file=sys.stderr)  # TrainingInterrupted says how to resume
        sys.exit(getattr(exc, "exit_code", 130))
    torch.save(model.state_dict(), out / "final.pt")
""")


def start(script, out, mode, sleep_s):
    return subprocess.Popen([sys.executable, str(script), str(out), mode, str(sleep_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_snapshot(proc, path, iteration, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.exists() and load_snapshot(path)["updater"]["iteration"] >= iteration:
            return
        time.sleep(0.02)
    raise AssertionError(f"no snapshot of iteration {iteration} after {timeout_s} s")


@pytest.fixture(scope="module")
def subprocess_runs(tmp_path_factory):
    """The uninterrupted run, a SIGKILLed one and a SIGTERMed one, started together; then
    both interrupted runs resumed to the end, together (each process start costs seconds)."""
    root = tmp_path_factory.mktemp("procs")
    script = root / "train_script.py"
    script.write_text(SCRIPT)
    dirs = {name: root / name for name in ("whole", "kill", "term")}
    procs = {name: start(script, d, "fresh", 0.0 if name == "whole" else 0.1)
             for name, d in dirs.items()}
    for name, sig in (("kill", signal.SIGKILL), ("term", signal.SIGTERM)):
        wait_for_snapshot(procs[name], dirs[name] / "snapshot_latest.pt", 5)
        procs[name].send_signal(sig)
    results = {name: p.communicate(timeout=120) + (p.returncode,) for name, p in procs.items()}
    assert results["whole"][2] == 0, results["whole"][1]
    stopped = {name: torch.load(dirs[name] / "snapshot_latest.pt", weights_only=True)
               for name in ("kill", "term")}
    resumes = {name: start(script, dirs[name], "resume", 0.0) for name in ("kill", "term")}
    for name, p in resumes.items():
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
    return dirs, results, stopped


def final_weights(out):
    return torch.load(out / "final.pt", weights_only=True)


def test_sigkill_then_resume_is_bit_identical(subprocess_runs):
    dirs, results, stopped = subprocess_runs
    assert results["kill"][2] == -signal.SIGKILL
    assert stopped["kill"]["updater"]["iteration"] < 40  # killed before the end
    assert_same_state(final_weights(dirs["whole"]), final_weights(dirs["kill"]))
    lines = (dirs["kill"] / "log.jsonl").read_text().splitlines()
    assert [json.loads(s)["iteration"] for s in lines] == [5 * i for i in range(1, 9)]


def test_sigterm_snapshots_exits_143_and_resumes_bit_identical(subprocess_runs):
    dirs, results, stopped = subprocess_runs
    _, stderr, code = results["term"]
    assert code == 143
    iteration = stopped["term"]["updater"]["iteration"]
    assert 5 <= iteration < 40
    snapshot = dirs["term"] / "snapshot_latest.pt"
    assert f"interrupted at iteration {iteration}; resume with: --resume {snapshot}" in stderr
    assert_same_state(final_weights(dirs["whole"]), final_weights(dirs["term"]))
