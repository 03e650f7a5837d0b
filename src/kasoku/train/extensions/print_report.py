"""PrintReport: Chainer's table of LogReport's entries on stdout."""
from __future__ import annotations

import sys

from kasoku.train.reporter import PRIORITY_READER

DEFAULT_ENTRIES = ("epoch", "main/loss", "validation/main/loss", "main/accuracy",
                   "validation/main/accuracy", "elapsed_time")


class PrintReport:
    """Prints a header once, then one row per new LogReport entry: fixed-width columns
    (at least 10 characters, two spaces apart), numbers in ``g`` format, blanks for values the
    entry lacks. Reads the extension named ``log_report`` (or that object); writes to ``out``
    (default: ``sys.stdout`` looked up at print time, so redirection works) and flushes each
    row, so it reads the same on a terminal, in a pipe and in a file."""
    trigger = (1, "iteration")
    priority = PRIORITY_READER
    name = "PrintReport"

    def __init__(self, entries=DEFAULT_ENTRIES, log_report="LogReport", out=None):
        self.entries = list(entries)
        self.log_report, self.out = log_report, out
        self.widths = [max(10, len(e)) for e in self.entries]
        self._printed = 0
        self._header_done = False
        self._source = None  # the LogReport, once resolved

    def header(self) -> str:
        return "  ".join(e.ljust(w) for e, w in zip(self.entries, self.widths)).rstrip() + "\n"

    def row(self, entry: dict) -> str:
        cells = []
        for key, width in zip(self.entries, self.widths):
            value = entry.get(key)
            cells.append(" " * width if value is None else f"{value:<{width}g}")
        return "  ".join(cells).rstrip() + "\n"

    def __call__(self, trainer) -> None:
        log = self._log(trainer)
        if len(log) <= self._printed:
            return
        out = self.out or sys.stdout
        if not self._header_done:
            out.write(self.header())
            self._header_done = True
        for entry in log[self._printed:]:
            out.write(self.row(entry))
        out.flush()
        self._printed = len(log)

    def initialize(self, trainer) -> None:
        self._log(trainer)  # resolves the LogReport, so the count below reads its log
        self._printed = min(self._printed, len(self._source.log))  # no final row of a past run

    def _log(self, trainer) -> list:
        source = self.log_report
        if isinstance(source, str):
            source = trainer.get_extension(source)
        self._source = source
        return getattr(source, "entries", source.log)

    def state_dict(self) -> dict:
        # Rows of the log as a snapshot keeps it (a final partial row is not kept there).
        kept = len(self._source.log) if self._source is not None else self._printed
        return {"printed": min(self._printed, kept)}

    def load_state_dict(self, state: dict) -> None:
        self._printed = int(state["printed"])
