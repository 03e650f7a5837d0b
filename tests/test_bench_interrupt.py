"""Ctrl-C during ``kasoku bench``: the run under way ends with every process it started, and
the sweep keeps the runs it finished: their table, chart and lines in results.jsonl, the
interruption said, exit code 130."""
from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time

import pytest

from kasoku.commands.bench import sweep as sweep_mod
from kasoku.commands.bench.process import run_process
from kasoku.commands.bench.rungs import PLAIN, rung_from_spec
from kasoku.commands.bench.sweep import SweepConfig, run_sweep


def test_ctrl_c_ends_the_run_under_way_with_its_processes():
    marker = f"kasoku-interrupt-test-{os.getpid()}"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
           f"'import time; time.sleep(60)', '{marker}']); time.sleep(60)"
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.time()
    with pytest.raises(KeyboardInterrupt):
        run_process([sys.executable, "-c", code], timeout_s=60)
    assert time.time() - began < 10
    time.sleep(0.2)
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmdline and state != "Z":
                alive.append(entry)
    assert not alive  # the run's own child went with it


def test_an_interrupted_sweep_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    calls = []

    def interrupted_on_the_second_run(cmd, timeout_s):
        calls.append(cmd)
        if len(calls) == 3:  # the peak probe, the first rung's run, then Ctrl-C
            raise KeyboardInterrupt
        return run_process(cmd, timeout_s)

    monkeypatch.setattr(sweep_mod, "run_process", interrupted_on_the_second_run)
    rungs = (PLAIN, rung_from_spec("+fused", "cpu"))
    cfg = SweepConfig("mnist-mlp", rungs, (8,), tmp_path, numerics_steps=0, profile_steps=0,
                      threads=1, peak_size=64, steps=3, windows=1, warmup=1)
    text = io.StringIO()
    result = run_sweep(cfg, stream=text)
    out = text.getvalue()
    assert result.interrupted and result.exit_code == 130
    assert [r["rung"] for r in result.records] == ["plain"]
    assert result.records[0]["status"] == "ok"
    assert "interrupted (SIGINT) after 1 of 2 runs: the table and chart show those" in out
    assert "not measured: +fused at bs 8" in out
    assert "interrupted after 1 run," in out  # the table's title
    assert (tmp_path / "ladder.png").exists() and result.chart is not None
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 1
