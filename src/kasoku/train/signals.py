"""SIGINT/SIGTERM during training: the step under way finishes, a snapshot is written, the run
ends resumable; a second signal stops at once (``KeyboardInterrupt``).

One process: a flag the trainer's loop reads between steps. The workers of a data-parallel run
share their flags (``kasoku.distributed.ddp.AgreedFlag``: one small all-reduce per step, read a
step later, so it never waits), so every worker stops at the same iteration and takes part in
the same snapshot, whichever of them got the signal; only worker 0 says so. A signal that
arrives while a worker is still starting (``defer_signals``) is kept for its first step.

Under kasoku's own launcher (``kasoku.distributed.launch``) a Ctrl-C reaches the workers as
SIGINT, passed on by the launching process, while SIGTERM is the elastic launcher stopping the
workers of a failed group: there a SIGTERM ends the worker at once (after its note), as a
worker whose peer hangs would otherwise keep the launcher waiting for its 30 s.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from kasoku.distributed import ddp
from kasoku.distributed.failures import JOB_DIR_ENV, note

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def graceful() -> tuple:
    """The signals that stop training after a snapshot: SIGINT and SIGTERM, or SIGINT alone
    under kasoku's launcher (see the module docstring)."""
    return (signal.SIGINT,) if os.environ.get(JOB_DIR_ENV) else SIGNALS


def _stopped_by_launcher(signum, frame) -> None:
    """SIGTERM under kasoku's launcher: the note that says so, then the signal's own end."""
    note("signalled", signal=signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install(handler) -> dict:
    """``handler`` for the graceful signals, and under kasoku's launcher the immediate end for
    SIGTERM; returns the handlers replaced."""
    previous = {s: signal.signal(s, handler) for s in graceful()}
    if signal.SIGTERM not in graceful():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _stopped_by_launcher)
    return previous

_early: list[int] = []  # a signal received before training started (defer_signals)


def defer_signals() -> None:
    """In a worker of a data-parallel run, before its trainer runs: the first SIGINT/SIGTERM
    is kept for the trainer (which stops after its first step, with the others), a second
    stops at once. Main thread only."""
    def keep(signum, frame):
        note("signalled", signal=signum)
        if _early:
            raise KeyboardInterrupt
        _early.append(signum)
    if threading.current_thread() is threading.main_thread():
        _install(keep)


class StopSignals:
    """Turns SIGINT/SIGTERM into a request the loop reads between steps (``due``); a second
    signal stops at once. ``agree``: this process is one worker of several, and all stop at
    the iteration where any of them asked (``due`` on every worker once per step). ``quiet``:
    say nothing (the workers other than 0). Handlers are restored on exit; only the main
    thread may install them, so elsewhere this is inert (``agree`` still follows the others)."""

    def __init__(self, active: bool = True, agree: bool = False, quiet: bool = False):
        self.received: int | None = None
        self.active, self.agree, self.quiet = active, agree, quiet
        self._previous: dict = {}
        self._agreed = None

    def _handle(self, signum, frame) -> None:
        note("signalled", signal=signum)  # not a failure of its own (kasoku.distributed.failures)
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        self._say(signum)

    def _say(self, signum: int) -> None:
        if self.quiet:
            return
        who = "every worker finishes this step and worker 0 writes" if self.agree else \
            "finishing this step and writing"
        print(f"\nreceived {signal.Signals(signum).name}: {who} a snapshot (signal again to "
              f"stop at once)", file=sys.stderr, flush=True)

    def due(self) -> int | None:
        """The signal to stop for, or None: this process's own, or with ``agree`` the one any
        worker received (the same answer on every worker at the same iteration)."""
        if self._agreed is None:
            return self.received
        return self._agreed.poll(self.received or 0) or None

    def __enter__(self) -> StopSignals:
        if self.active and threading.current_thread() is threading.main_thread():
            self._previous = _install(self._handle)
            if _early:
                self.received = _early.pop()
                self._say(self.received)
        if self.active and self.agree:
            self._agreed = ddp.AgreedFlag()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if self._agreed is not None:
                self._agreed.close()
        except Exception:
            if exc_type is None:  # else the error that ended the run is the one to see
                raise
        finally:
            for s, handler in self._previous.items():
                # None: the old handler was installed from C; the default is the closest.
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
