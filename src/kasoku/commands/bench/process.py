"""One bench run's process: started in a session of its own, ended with everything it
started on a timeout or when the sweep is interrupted, its record read from its output."""
from __future__ import annotations

import json
import os
import signal
import subprocess


def run_process(cmd: list[str], timeout_s: float) -> tuple[str | int, str, str]:
    """``(exit code or "timeout", stdout, stderr)`` of ``cmd``. A session of its own, so a
    timeout also ends the compiler workers the run started, and a terminal's Ctrl-C reaches
    the sweep alone: then the run is ended with them and the ``KeyboardInterrupt`` goes on."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return "timeout", stdout, stderr
    except KeyboardInterrupt:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise


def parse_record(stdout: str) -> dict | None:
    """The run's record: the last JSON line of its stdout with a status."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "status" in record:
                return record
    return None
