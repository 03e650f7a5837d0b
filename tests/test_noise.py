"""Noise measured and shown: a figure's spread over its windows, what the machine did while
they ran (real processes keeping a core busy, read from /proc), the threads kept off a busy
core, and a bench run beside a CPU hog that either agrees with a quiet one or says it is
unstable."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kasoku.perf.noise import MachineWatch, Stability, free_cpus, spread

HAS_PROC = os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(not HAS_PROC or len(CPUS) < 2,
                               reason="needs /proc and at least 2 CPUs")
HOG = "import time\nwhile True: pass"


@contextlib.contextmanager
def hog(cpu: int, own: bool = False):
    """A process keeping ``cpu`` busy: another process's (reparented away from this one, as a
    user's other program would be), or with ``own`` a child of this one. Yields its pid."""
    if own:
        proc = subprocess.Popen([sys.executable, "-c", HOG])
        pid = proc.pid
    else:  # the shell exits at once: the hog is nobody's child of ours
        out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{HOG}' >/dev/null 2>&1 & "
                              "echo $!"], capture_output=True, text=True, check=True).stdout
        pid = int(out.strip())
    os.sched_setaffinity(pid, [cpu])
    try:
        time.sleep(0.3)  # running flat out before anything is read
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        if own:
            proc.wait()


def test_spread_leaves_out_the_extremes_from_six_windows():
    s = spread([10.0, 10.2, 9.9, 10.1])
    assert (s.median, s.min, s.max, s.n) == (10.05, 9.9, 10.2, 4)
    assert s.spread == pytest.approx(0.3 / 10.05) and s.stable
    one_bad = spread([10.0, 10.5, 10.2, 9.9, 30.0, 10.1])  # one disturbed window of six
    assert one_bad.max == 30.0 and one_bad.stable
    assert not spread([10.0, 30.0, 10.0]).stable  # of three, it decides
    assert spread([1.0, 2.0]).overlaps(spread([1.9, 3.0]))
    assert not spread([1.0, 2.0]).overlaps(spread([2.1, 3.0]))


def test_an_unstable_spread_says_why():
    st = Stability(spread([100.0, 150.0, 120.0]))
    assert not st.stable and "range over 42% of their median" in st.reasons[0]
    assert st.to_dict()["stable"] is False


@needs_two
def test_another_process_on_the_runs_cpus_is_named():
    with hog(CPUS[-1]) as pid:
        watch = MachineWatch(cpus=CPUS).start()
        time.sleep(1.0)
        state = watch.stop()
    assert state.others_cores > 0.6
    assert any(p["pid"] == pid and p["cores"] > 0.6 for p in state.top_others)
    reasons = Stability(spread([1.0, 1.0]), state).reasons
    assert reasons and f"pid {pid}" in reasons[0] and "cores of the run's" in reasons[0]


@needs_two
def test_this_process_and_its_children_are_not_others():
    with hog(CPUS[-1], own=True):
        watch = MachineWatch(cpus=CPUS).start()
        time.sleep(1.0)
        state = watch.stop()
    assert state.others_cores < 0.5, state.to_dict()
    assert not state.reasons()


@needs_two
def test_a_busy_core_is_taken_and_the_threads_avoid_it():
    busy_cpu = CPUS[-1]
    with hog(busy_cpu):
        free, taken = free_cpus(CPUS)
        assert busy_cpu in taken and busy_cpu not in free and taken[busy_cpu] > 0.5
        # A fresh process sets its threads as a bench worker does: off the busy core.
        code = textwrap.dedent("""
            import json
            from kasoku.accel.cpu_threads import apply_cpu_threads
            print(json.dumps(apply_cpu_threads()))
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(busy_cpu) in record["busy_cpus"]
    assert record["pinned_cpus"] and busy_cpu not in record["pinned_cpus"]
    assert record["threads"] == len(record["pinned_cpus"])
    assert f"CPU {busy_cpu}" in record["note"]


def _plain_run(out) -> dict:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return next(r for r in lines if r["rung"] == "plain" and r["status"] == "ok")


@needs_two
def test_a_bench_beside_a_cpu_hog_agrees_with_a_quiet_one_or_says_it_is_unstable(tmp_path):
    argv = [sys.executable, "-m", "kasoku", "bench", "mnist-mlp", "--device", "cpu",
            "--batch-size", "100", "--config", "plain", "--numerics-steps", "0",
            "--steps", "20", "--windows", "3", "--warmup", "2", "--peak-size", "256"]
    with hog(CPUS[-1]):
        busy = subprocess.run([*argv, "--out", str(tmp_path / "busy")], check=True,
                              capture_output=True, text=True)
    loaded = _plain_run(tmp_path / "busy")
    stability = loaded["figures"]["stability"]
    if stability["stable"]:  # then it must agree with a quiet run
        subprocess.run([*argv, "--out", str(tmp_path / "quiet")], check=True,
                       capture_output=True)
        q = _plain_run(tmp_path / "quiet")["figures"]["samples_per_s"]["median"]
        b = loaded["figures"]["samples_per_s"]["median"]
        assert abs(b / q - 1) <= 0.10, (q, b, stability)
    else:  # said where a reader sees it: the table and its notes
        assert "unstable figures (!)" in busy.stdout and "!" in busy.stdout
        assert any("other processes used" in r for r in stability["reasons"])
    # The busy core was seen, named, and kept out of the threads.
    note = loaded["settings"]["cpu_threads"]["note"]
    assert note and f"CPU {CPUS[-1]}" in note
