"""Interrupts from a command's first instruction to its last: a Ctrl-C while kasoku is still
importing is one line and exit code 130 (real processes, signalled as early as Python can
take a signal); ``kasoku bench`` stopped by SIGINT or SIGTERM even when started with SIGINT
ignored, its workers ended with it, its interrupted ladder saying what is left and how to
measure it, and an empty folder it made removed."""
from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kasoku.commands.bench import sweep as sweep_mod
from kasoku.commands.bench.interrupted import interrupted_lines, missing_runs
from kasoku.commands.bench.rungs import PLAIN, rung_from_spec
from kasoku.commands.bench.sweep import SweepConfig, run_sweep
from kasoku.core.interrupts import Stopped, signal_of, stoppable, stopped_line
from kasoku.train.run_dir import new_folders, remove_empty

ROOT = Path(__file__).resolve().parents[1]


def _interrupt_when_imported(argv: list[str], module: str, tmp_path: Path):
    """Start ``kasoku ARGV``, SIGINT it the moment it has imported ``module`` (Python's
    ``-X importtime`` lines say so as each import ends); returns ``(exit code, stderr lines
    other than those import lines)``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "kasoku", *argv],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("import time:") and line.split("|")[-1].strip() == module:
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.read().splitlines()
    proc.wait(timeout=60)
    return proc.returncode, [ln for ln in lines if not ln.startswith("import time:")]


@pytest.mark.parametrize("command, module", [("train", "kasoku.cli.args"),
                                             ("train", "torch.overrides"),
                                             ("bench", "torch.overrides")])
def test_ctrl_c_while_importing_is_one_line_and_130(tmp_path, command, module):
    """SIGINT as kasoku's command line starts to import, and in the middle of torch's import:
    no traceback, one line, 130, no folder."""
    code, err = _interrupt_when_imported([command, "mnist-mlp", "--device", "cpu", "--out",
                                          str(tmp_path / "run")], module, tmp_path)
    assert err == ["kasoku: interrupted"], err
    assert code == 130
    assert not (tmp_path / "run").exists()


def test_stoppable_takes_sigint_even_when_ignored_and_sigterm():
    """As a shell starts ``cmd &`` from a script, SIGINT ignored: within ``stoppable`` it
    stops the command all the same, and so does SIGTERM; the handlers are restored after."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(Stopped) as caught, stoppable():
                os.kill(os.getpid(), signum)
                signal.sigtimedwait([], 0.5)  # the handler runs here at the latest
            assert caught.value.signum == signum and signal_of(caught.value) == signum
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert stopped_line(Stopped(signal.SIGTERM)) == "kasoku: stopped by SIGTERM"
        assert stopped_line(KeyboardInterrupt()) == "kasoku: interrupted"
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_lines_of_an_interrupted_ladder_say_what_is_left_and_how_to_measure_it(tmp_path):
    argv = ["bench", "mnist-mlp", "--device", "cpu", "--config", "fp32", "--batch-size=12,25",
            "--windows", "5", "--out", "old", "--full"]
    missing = [("+fused", (25,)), ("+keep-memory", (12, 25)), ("+bf16", (12, 25))]
    lines = interrupted_lines(signal.SIGTERM, 3, 8, missing, argv, tmp_path / "b")
    base = f"kasoku bench mnist-mlp --device cpu --windows 5 --out {tmp_path / 'b'}"
    assert lines == [
        "interrupted (SIGTERM) after 3 of 8 runs: the table and chart show those",
        "not measured: +fused at bs 25; +keep-memory at bs 12, 25; +bf16 at bs 12, 25",
        "to measure them into the same folder (plain is measured again beside them, as the "
        "speed-ups are over it):",
        f"  {base} --config +fused --batch-size 25",
        f"  {base} --config +keep-memory --config +bf16 --batch-size 12,25",
        f"then the whole ladder: {base} --report"]
    loader = interrupted_lines(signal.SIGINT, 1, 2, [("+loader", (8,))], ["bench", "x"],
                               tmp_path)
    assert loader[2] == ("to measure them, run the command again (its lines are appended to "
                         "results.jsonl): kasoku bench x")
    assert interrupted_lines(signal.SIGINT, 0, 2, missing, argv, tmp_path, removed=True) == [
        f"interrupted (SIGINT) before the first run finished: nothing was measured; removed "
        f"the empty folder {tmp_path}"]
    rungs = [PLAIN, rung_from_spec("+fused", "cpu")]
    done = [{"rung": "plain", "batch_size": 8}]
    assert missing_runs(rungs, (8, 16), done) == [("plain", (16,)), ("+fused", (8, 16))]


def test_only_the_empty_folders_the_sweep_made_are_removed(tmp_path):
    made = new_folders(tmp_path / "runs" / "bench")
    assert made == [tmp_path / "runs" / "bench", tmp_path / "runs"]
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    assert remove_empty(made) and not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    (tmp_path / "runs" / "keep.txt").write_text("someone's")
    assert remove_empty(made) and (tmp_path / "runs" / "keep.txt").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "results.jsonl").write_text("{}\n")
    assert new_folders(tmp_path / "kept") == []  # there already: not the sweep's to remove
    assert not remove_empty([tmp_path / "kept"]) and (tmp_path / "kept").exists()


@pytest.mark.parametrize("existed", [False, True])
def test_a_sweep_interrupted_before_its_first_run_leaves_no_folder_it_made(tmp_path,
                                                                          monkeypatch, existed):
    def stopped(cmd, timeout_s):  # the peak probe, the first process the sweep starts
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(sweep_mod, "run_process", stopped)
    out = tmp_path / "bench"
    if existed:
        out.mkdir()
    cfg = SweepConfig("mnist-mlp", (PLAIN,), (8,), out, numerics_steps=0, profile_steps=0)
    text = io.StringIO()
    result = run_sweep(cfg, stream=text)
    assert result.exit_code == 143 and not result.records
    assert out.exists() == existed
    assert ("removed the empty folder" in text.getvalue()) != existed


def test_a_command_stopped_before_writing_leaves_no_out_folder_of_its_own(tmp_path, capsys):
    """Any command (profile, scale, ...): the --out it would have made is not left empty; one
    it did not make, or one with files, is kept; one line, 128 + the signal."""
    from kasoku import cli

    def stopped(args):
        args.out.mkdir(parents=True, exist_ok=True)
        raise Stopped(signal.SIGTERM)

    made = tmp_path / "runs" / "profile"
    assert cli._run(argparse.Namespace(out=made, handler=stopped)) == 143
    assert not (tmp_path / "runs").exists()
    assert capsys.readouterr().err == "kasoku: stopped by SIGTERM\n"
    kept = tmp_path / "kept"
    kept.mkdir()
    assert cli._run(argparse.Namespace(out=kept, handler=stopped)) == 143 and kept.exists()
