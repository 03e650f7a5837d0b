"""PlotReport: a PNG of LogReport's values against epoch (or iteration)."""
from __future__ import annotations

import os
import time

from kasoku.train.reporter import PRIORITY_READER


class PlotReport:
    """Redraws ``out/filename`` whenever LogReport's ``log`` has grown: one line per key of
    ``y_keys`` against ``x_key``; entries without a key are skipped. matplotlib is imported
    on the first draw and used through its Agg canvas directly (no pyplot, no global backend
    change), and the file is written to a temporary name and renamed, so a viewer never sees
    a half-written image.

    A redraw costs tens of milliseconds, so it happens at most every ``min_interval_s``
    seconds (the first one ``min_interval_s`` after training starts), and once more in
    ``finalize`` if the log grew since: a short epoch of a small model is not held up by
    drawing charts. matplotlib (~0.5 s to import) is imported in ``initialize``, before the
    trainer's clock starts, as the rest of the program's imports are."""
    trigger = (1, "iteration")
    priority = PRIORITY_READER
    name = "PlotReport"

    def __init__(self, y_keys, x_key: str = "epoch", filename: str = "loss.png",
                 log_report="LogReport", marker: str | None = ".",
                 min_interval_s: float = 10.0):
        self.y_keys = [y_keys] if isinstance(y_keys, str) else list(y_keys)
        self.x_key, self.filename, self.marker = x_key, filename, marker
        self.log_report = log_report
        self.min_interval_s = min_interval_s
        self._plotted, self._drawn_at = 0, None

    def initialize(self, trainer) -> None:
        import matplotlib.backends.backend_agg  # noqa: F401 - imported here, not mid-training
        import matplotlib.figure  # noqa: F401
        self._drawn_at = time.monotonic()  # the first redraw is due min_interval_s from now

    def __call__(self, trainer) -> None:
        if self._drawn_at is None or time.monotonic() - self._drawn_at >= self.min_interval_s:
            self._draw_if_new(trainer)

    def finalize(self, trainer) -> None:
        self._draw_if_new(trainer)

    def _draw_if_new(self, trainer) -> None:
        source = self.log_report
        log = (trainer.get_extension(source) if isinstance(source, str) else source).log
        if len(log) > self._plotted:
            self.draw(log, trainer.out / self.filename)
            self._plotted, self._drawn_at = len(log), time.monotonic()

    def draw(self, log: list[dict], path) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.0))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key in self.y_keys:
            points = [(e[self.x_key], e[key]) for e in log if key in e and self.x_key in e]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=self.marker, label=key)
        ax.set_xlabel(self.x_key)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
