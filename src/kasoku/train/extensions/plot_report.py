"""PlotReport: a PNG of LogReport's values against epoch (or iteration)."""
from __future__ import annotations

import math
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
                 min_interval_s: float = 10.0, title: str | None = None,
                 xlabel: str | None = None, ylabel: str | None = None, log_y: bool = False,
                 y_range: tuple[float, float] | None = None):
        """``title``, ``xlabel``, ``ylabel``: the chart's (default: the keys); ``log_y``: a
        logarithmic y axis (losses: the first epochs' fall would flatten the rest on a linear
        one; values that are not positive are left out); ``y_range``: the bounds the values
        live in (accuracy: 0 to 1): the axis zooms to the data and never runs past them by
        more than a margin that keeps a point on them whole."""
        self.y_keys = [y_keys] if isinstance(y_keys, str) else list(y_keys)
        self.x_key, self.filename, self.marker = x_key, filename, marker
        self.log_report = log_report
        self.min_interval_s = min_interval_s
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.log_y, self.y_range = log_y, y_range
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
        source = trainer.get_extension(source) if isinstance(source, str) else source
        log = getattr(source, "entries", source.log)
        if len(log) > self._plotted:
            self.draw(log, trainer.out / self.filename)
            self._plotted, self._drawn_at = len(log), time.monotonic()

    def draw(self, log: list[dict], path) -> None:
        """Write ``figure(log)`` to ``path`` (through a temporary file and a rename)."""
        fig = self.figure(log)
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)

    def figure(self, log: list[dict]):
        """The chart of ``log`` as a matplotlib ``Figure`` (Agg canvas, no pyplot)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.0))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        xs_all, ys_all = [], []
        for key in self.y_keys:
            # A log written before entries had epoch_detail gives its epoch instead.
            points = [(e.get(self.x_key, e.get("epoch")), e[key]) for e in log
                      if _plottable(e.get(key), self.log_y)
                      and e.get(self.x_key, e.get("epoch")) is not None]
            if points:
                xs, ys = zip(*points)
                xs_all += xs
                # One point would be a lone dot at the centre of an arbitrary axis: draw it
                # as a marker on the axes below, with its value written beside it.
                line, = ax.plot(xs, ys, marker=self.marker or ".", label=_label(key),
                                linestyle="-" if len(xs) > 1 else "none",
                                markersize=6 if len(xs) > 3 else 9)
                ys_all += ys
                if len(xs) == 1:
                    for x, y in points:
                        ax.annotate(f"{y:.4g}", (x, y), textcoords="offset points",
                                    xytext=(-8, 6), ha="right", fontsize=8,
                                    color=line.get_color())
        ax.margins(y=0.15)
        if self.y_range is not None and ys_all:
            ax.set_ylim(*_zoomed(min(ys_all), max(ys_all), *self.y_range))
        if self.log_y:
            log_axis(ax)
        if xs_all:  # progress starts at 0: the x axis does too
            ax.set_xlim(0, max(xs_all) * 1.05 if max(xs_all) > 0 else 1)
        ax.set_xlabel(self.xlabel or self.x_key)
        ax.set_ylabel(self.ylabel or ", ".join(self.y_keys))
        ax.set_title(self.title or ", ".join(self.y_keys))
        ax.grid(True, alpha=0.3, which="both" if self.log_y else "major")
        if ax.lines:
            ax.legend(loc="best")  # where it covers the fewest points
        return fig


def _zoomed(low: float, high: float, lower: float, upper: float) -> tuple[float, float]:
    """Y limits around the data ``low .. high``, inside the bounds ``lower .. upper`` but for
    a margin that keeps a marker on a bound whole."""
    pad = max(0.1 * (high - low), 0.01 * (upper - lower))
    edge = 0.02 * (upper - lower)
    return max(lower - edge, low - pad), min(upper + edge, high + pad)


def log_axis(ax) -> None:
    """A log y axis whose labels read 0.3, not 3 x 10^-1, and never crowd: across several
    decades the decades alone; within fewer, 1-2-5 steps, or for a span under half a decade
    finer ones (1, 1.5, 2, 3, 4, 5, 6, 8), or for a span narrower than those evenly spaced round
    values, so a short run's axis still shows numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:.3g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())
    low, high = ax.get_ylim()
    if low <= 0:
        return
    decades = math.log10(high / low)
    if decades >= 2:
        return  # matplotlib's decades
    subs = (1, 2, 5) if decades >= 0.5 else (1, 1.5, 2, 3, 4, 5, 6, 8)
    ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(low)) - 1,
                                          math.ceil(math.log10(high)) + 1)
             for m in subs if low <= m * 10.0 ** k <= high]
    if len(ticks) < 2:  # a span too narrow for any of them (one epoch's two losses)
        ticks, plain = _even_ticks(low, high)
        ax.yaxis.set_major_formatter(plain)
    if len(ticks) >= 2:
        ax.yaxis.set_major_locator(FixedLocator(ticks))


def _even_ticks(low: float, high: float):
    """Evenly spaced round ticks inside ``low .. high`` (1-2-5 steps), and a formatter
    with as many decimals as the step needs, so no two labels read the same."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    ticks = [t for t in MaxNLocator(nbins=4, steps=[1, 2, 5, 10]).tick_values(low, high)
             if low <= t <= high]
    step = ticks[1] - ticks[0] if len(ticks) >= 2 else high - low
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 3
    return ticks, FuncFormatter(lambda v, _: f"{v:.{decimals}f}")


def _plottable(value, log_y: bool) -> bool:
    """A finite number (positive on a log axis): a diverged run's NaN or Inf is left out."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > 0 or not log_y)


def _label(key: str) -> str:
    """``main/loss`` -> ``training``, ``validation/main/loss`` -> ``validation``: the chart's
    title and y label name the quantity, the legend says whose it is."""
    prefix, _, rest = key.rpartition("/main/")
    if rest and prefix:
        return prefix
    return "training" if key.startswith("main/") else key
