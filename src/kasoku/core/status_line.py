"""One line of progress (``make-jpeg: 300/1000 images``) that reads well on a terminal and in
a log: redrawn in place on a terminal, whole lines, few of them, anywhere else."""
from __future__ import annotations

import sys
import time


class StatusLine:
    """Progress on ``stream`` (default: ``sys.stderr`` as it is when made). On a terminal each
    ``update`` redraws the line in place (``\\r``); on a pipe or a file, where ``\\r`` updates
    would glue into one endless line, each is a line of its own, at most one per ``every_s``
    seconds (the first at once), and ``close`` writes the latest one held back, so a log ends
    with the final count. Use it as a context manager, or call ``close`` when done."""

    def __init__(self, stream=None, every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._width = 0  # of the line drawn on the terminal, blanked when a shorter one follows
        self._written_at: float | None = None
        self._held: str | None = None

    def update(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = max(self._width, len(text))
        else:
            now = time.monotonic()
            if self._written_at is not None and now - self._written_at < self.every_s:
                self._held = text
                return
            self.stream.write(text + "\n")
            self._written_at, self._held = now, None
        self.stream.flush()

    def close(self) -> None:
        """End the line on a terminal; elsewhere write the update held back, if any."""
        if self.tty and self._width:
            self.stream.write("\n")
        elif self._held is not None:
            self.stream.write(self._held + "\n")
        self._width, self._held = 0, None
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
