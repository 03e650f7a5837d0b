"""SIGINT and SIGTERM as an interruption a command can finish from: ``stoppable`` makes both
raise ``Stopped`` (a ``KeyboardInterrupt`` naming its signal) in the main thread, so the
command's own ``except KeyboardInterrupt`` ends the processes it started, keeps what it
measured and says how to go on.

Two things it changes against Python's defaults, on purpose. SIGTERM, by default the end of
the process with nothing run, would leave the workers a command started in sessions of their
own running (``kasoku bench``'s). And SIGINT is taken even when the process started with it
ignored: a shell starts ``cmd &`` from a script that way, and Python then installs no handler
of its own, so such a command could not be stopped by SIGINT while ``kasoku train`` (whose
``kasoku.train.signals`` handlers are installed whatever was there) could. A long command meant
to outlive its script's Ctrl-C is started in a session of its own (``setsid kasoku ...``).

Imports nothing of kasoku: every layer may use it.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A signal stopped the command: ``signum`` (the exit code is 128 + its number, as a shell
    reports it: 130 SIGINT, 143 SIGTERM). Unlike ``kasoku.train.TrainingInterrupted`` it
    carries no ``exit_code``: nothing has said yet that the command stopped."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind an interruption: ``Stopped``'s, else SIGINT (Python's own handler,
    a Ctrl-C)."""
    return getattr(exc, "signum", None) or signal.SIGINT


def stopped_line(exc: KeyboardInterrupt) -> str:
    """The one line of a command an interruption stopped before it could say more."""
    signum = signal_of(exc)
    return "kasoku: interrupted" if signum == signal.SIGINT else \
        f"kasoku: stopped by {signal.Signals(signum).name}"


def _raise(signum, frame) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def handled(handler):
    """Within: SIGINT and SIGTERM call ``handler(signum, frame)``, whatever they were set to
    before (ignored included); restored on exit. Only the main thread may set handlers, so
    elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, before in previous.items():
            # None: a handler installed from C; the default is the closest.
            signal.signal(s, signal.SIG_DFL if before is None else before)


@contextlib.contextmanager
def stoppable():
    """Within: SIGINT and SIGTERM raise ``Stopped`` (``handled``)."""
    with handled(_raise):
        yield
