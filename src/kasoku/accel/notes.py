"""How a lever says it cannot apply on this device: one warning per process, and a note.

Every ``apply_*`` transform takes ``notes`` (a list, or None) and appends one line per lever
it skipped or adjusted; ``kasoku.accel.compose.accelerate`` returns them so a benchmark can
record what actually ran. The warning is printed once per process however many models are
accelerated (a bench subprocess, a test session).
"""
from __future__ import annotations

from kasoku.core import errors
from kasoku.core.errors import KasokuWarning, reset_warnings

__all__ = ["LeverWarning", "reset_warnings", "skip", "warn_once"]


class LeverWarning(KasokuWarning):
    """A lever has no effect on this device or model and was skipped or adjusted."""


def warn_once(message: str) -> None:
    """A ``LeverWarning`` with ``message``, once per process."""
    errors.warn_once(message, LeverWarning)


def skip(notes: list[str] | None, message: str) -> None:
    """Record ``message`` in ``notes`` (every time) and warn with it (once per process)."""
    if notes is not None:
        notes.append(message)
    warn_once(message)
